"""The decision core: pure functions that decide where one request goes, and the state they read.

No await, no clock reads (`now` is a parameter), no network: the endpoint
snapshot, the live state (with the cost model's bookkeeping), the breaker, the
balancer's filter -> score -> pick, admission decisions, prefix affinity and the
predicted-TTFT cost model, the error tree. Imports nothing else of the router.
"""
