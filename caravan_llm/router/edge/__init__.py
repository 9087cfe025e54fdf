"""The edge: every client request from the connection to the engine's answer.

The listener's connection limits, the request guard (keys, rate limits,
priority grants, the body read and parsed once into a `ParsedRequest`), the
admission gate (pick now, queue, hold), the proxy and its stream continuation.
"""
