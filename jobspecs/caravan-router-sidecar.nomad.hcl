# An application with its own caravan router as a sidecar task: the router
# runs in the application's task group and listens on the group's loopback,
# so the application calls http://127.0.0.1:<router_port>/v1 with no extra
# network hop and no central router to lose. Copy the `caravan-router` task
# (and the group's bridge network) into your own job; the `app` task stands
# for your application.
#
# Choose the sidecar when one application (or a few) uses the models and its
# latency or availability should not depend on a shared router; choose the
# system job (caravan-router.nomad.hcl) to give many clients one endpoint.
# docs/deploy.md compares the two.
#
# The sidecar reads the same Consul view as every router and needs the same
# Consul and Nomad policies (docs/security.md); its tokens come from the
# application job's own Nomad Variable `nomad/jobs/<job>`.

variable "app_image" {
  type        = string
  description = "Image of the application task"
  default     = "registry.example.com/chat-app:1.0.0"
}

variable "image" {
  type        = string
  description = "caravan container image (built from the repository's Dockerfile)"
  default     = "caravan:0.1.0"
}

variable "datacenters" {
  type        = list(string)
  description = "Datacenters the application may run in"
  default     = ["*"]
}

variable "namespace" {
  type        = string
  description = "Nomad namespace of this job"
  default     = "default"
}

variable "caravan_namespace" {
  type        = string
  description = "caravan's Nomad namespace, where the scheduler keeps the engines' API keys the router reads"
  default     = "caravan"
}

variable "region" {
  type        = string
  description = "Nomad region of this job"
  default     = "global"
}

variable "router_port" {
  type        = number
  description = "Port the sidecar router listens on, on the group's loopback only"
  default     = 8080
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API address as the task sees it; empty means the node's agent on port 8500"
  default     = ""
}

variable "nomad_addr" {
  type        = string
  description = "Nomad HTTP API address as the task sees it (the router reads engine keys there); empty means the node's agent on port 4646"
  default     = ""
}

variable "kv_prefix" {
  type        = string
  description = "Consul KV prefix of caravan's state; must end with a slash"
  default     = "caravan/"

  validation {
    condition     = trimsuffix(var.kv_prefix, "/") != var.kv_prefix && trimprefix(var.kv_prefix, "/") == var.kv_prefix
    error_message = "The kv_prefix must end with a slash and must not start with one, like \"caravan/\"."
  }
}

variable "cpu" {
  type        = number
  description = "CPU of the sidecar router, in MHz"
  default     = 200
}

variable "memory" {
  type        = number
  description = "Memory of the sidecar router, in MiB"
  default     = 128
}

job "chat-app" {
  type        = "service"
  region      = var.region
  namespace   = var.namespace
  datacenters = var.datacenters

  group "app" {
    count = 2

    # One network namespace for the group: the application reaches the
    # router on 127.0.0.1, and nothing outside the group can.
    network {
      mode = "bridge"
    }

    task "caravan-router" {
      driver = "docker"

      # Started before the application and kept running beside it.
      lifecycle {
        hook    = "prestart"
        sidecar = true
      }

      config {
        image = var.image
        args = [
          "router",
          "--host", "127.0.0.1",
          "--port", "${var.router_port}",
          "--kv-prefix", var.kv_prefix,
        ]
      }

      # A sidecar serves its own application only: no Consul registration of
      # its own (clients never look it up), a slower scrape of engine load
      # (it sees a small share of the traffic), and a short drain: it stops
      # with its application.
      # The node's agents are not on the group's loopback (bridge mode): they
      # are reached at the node's address.
      env {
        CONSUL_HTTP_ADDR                   = var.consul_addr != "" ? var.consul_addr : "http://${attr.unique.network.ip-address}:8500"
        NOMAD_ADDR                         = var.nomad_addr != "" ? var.nomad_addr : "http://${attr.unique.network.ip-address}:4646"
        NOMAD_NAMESPACE                    = var.caravan_namespace
        CARAVAN_ROUTER_REGISTER_SERVICE    = "false"
        CARAVAN_ROUTER_SCRAPE_INTERVAL_S   = "2"
        CARAVAN_ROUTER_SHUTDOWN_TIMEOUT_S  = "10"
        CARAVAN_ROUTER_QUEUE_MAX_PER_MODEL = "64"
      }

      # The Consul token (and the Nomad token that reads the engines' keys)
      # from the application job's own Nomad Variable `nomad/jobs/chat-app`,
      # keys consul_token and nomad_token (rename the path with the job).
      # Workload identity can stand in for nomad_token: attach the
      # caravan-router Nomad policy to this job instead.
      template {
        destination = "secrets/caravan.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/chat-app" -}}
        {{ with nomadVar "nomad/jobs/chat-app" -}}
        {{ with .consul_token.Value }}CONSUL_HTTP_TOKEN={{ . }}{{ end }}
        {{ with .nomad_token.Value }}NOMAD_TOKEN={{ . }}{{ end }}
        {{- end }}
        {{- end }}
        EOT
      }

      resources {
        cpu    = var.cpu
        memory = var.memory
      }
    }

    task "app" {
      driver = "docker"

      config {
        image = var.app_image
      }

      # What the official OpenAI clients read: the sidecar on loopback.
      env {
        OPENAI_BASE_URL = "http://127.0.0.1:${var.router_port}/v1"
        OPENAI_API_KEY  = "unused-on-loopback"
      }

      resources {
        cpu    = 500
        memory = 256
      }
    }
  }
}
