"""The feeds: what keeps the decision core's inputs current, in the background.

Consul discovery (snapshot, declared models, drain markers), engine load
scrapes, the scheduler's failure records, the engines' API keys from Nomad.
"""
