"""The wiring: build the router's objects and its aiohttp app, run the process.

The app and its background tasks, the process (logging, listener,
registration, shutdown), the workers' supervisor, and the entry point.
"""
