# Deploys caravan's control plane (scheduler and routers) on an existing Nomad
# + Consul, and declares models as Consul KV entries the scheduler reconciles
# into replica jobs. Providers are configured by the caller (see
# examples/basic).

locals {
  # Model name => profile file. The name is read from the profile itself, so
  # the key always matches the model the scheduler reads back; two files with
  # the same name fail the plan with a duplicate-key error.
  profiles = { for path in var.profile_files : yamldecode(file(path)).name => path }
}

resource "nomad_job" "scheduler" {
  jobspec          = file("${path.module}/../jobspecs/caravan-scheduler.nomad.hcl")
  purge_on_destroy = var.purge_on_destroy

  # Values travel as strings: numbers and strings are taken literally, and
  # lists are parsed as HCL, so they are JSON-encoded.
  hcl2 {
    vars = {
      image          = var.image
      datacenters    = jsonencode(var.datacenters)
      namespace      = var.namespace
      region         = var.region
      count          = tostring(var.scheduler_count)
      nomad_addr     = var.nomad_addr
      consul_addr    = var.consul_addr
      kv_prefix      = var.kv_prefix
      cluster_config = var.cluster_config
      cpu            = tostring(var.scheduler_cpu)
      memory         = tostring(var.scheduler_memory)
    }
  }
}

resource "nomad_job" "router" {
  jobspec          = file("${path.module}/../jobspecs/caravan-router.nomad.hcl")
  purge_on_destroy = var.purge_on_destroy

  hcl2 {
    vars = {
      image          = var.image
      datacenters    = jsonencode(var.datacenters)
      namespace      = var.namespace
      region         = var.region
      node_class     = var.router_node_class
      http_port      = tostring(var.router_http_port)
      consul_addr    = var.consul_addr
      nomad_addr     = var.nomad_addr
      kv_prefix      = var.kv_prefix
      shutdown_delay = var.router_shutdown_delay
      kill_timeout   = var.router_kill_timeout
      cpu            = tostring(var.router_cpu)
      memory         = tostring(var.router_memory)
    }
  }
}

# One resource per model, so adding or removing a profile touches only its own
# key. The value is the profile as JSON, which the scheduler validates the same
# way as a `caravan submit`.
resource "consul_keys" "models" {
  for_each = local.profiles

  key {
    path   = "${var.kv_prefix}models/${each.key}"
    value  = jsonencode(yamldecode(file(each.value)))
    delete = true
  }

  # Created after the scheduler and deleted before it. Deleting a model only
  # stops its replicas when the scheduler reconciles before it is stopped
  # itself, so retire models with an apply first (README.md).
  depends_on = [nomad_job.scheduler]
}
