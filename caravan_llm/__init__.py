"""caravan: LLM inference replicas on Nomad, discovered through Consul, behind one router.

One import package, so that caravan installs beside any other distribution:
`caravan_llm.common` (the contract, the Nomad and Consul adapters), `.scheduler`,
`.router`, `.devcluster` (the local stand-in, with the `demo` extra) and `.cli`
(the `caravan` command). The repository's `scheduler/`, `router/` and
`devcluster/` folders lead here.
"""
