# caravan router: the OpenAI-compatible endpoint. A system job, so every
# client-facing node runs one; clients find them through Consul DNS
# (`caravan-router.service.consul`) or reach any node on the static port.
#
# The routers are stateless and active-active: each one watches Consul for the
# model replicas (services tagged `caravan`) and proxies requests to them.
#
# The Consul token (and optional API keys) come from the Nomad Variable
# `nomad/jobs/caravan-router` (in the job's namespace); see
# jobspecs/README.md for `nomad var put`.

variable "image" {
  type        = string
  description = "caravan container image (built from the repository's Dockerfile)"
  default     = "caravan:0.1.0"
}

variable "datacenters" {
  type        = list(string)
  description = "Datacenters whose nodes run a router"
  default     = ["*"]
}

variable "namespace" {
  type        = string
  description = "Nomad namespace of this job"
  default     = "default"
}

variable "region" {
  type        = string
  description = "Nomad region of this job"
  default     = "global"
}

variable "node_class" {
  type        = string
  description = "Run routers only on nodes of this node class; empty means every node"
  default     = ""
}

variable "http_port" {
  type        = number
  description = "Port the router listens on; 0 lets Nomad pick one per node"
  default     = 8080
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API address as seen from the task (the local agent by default)"
  default     = "http://127.0.0.1:8500"
}

variable "nomad_addr" {
  type        = string
  description = "Nomad HTTP API address as seen from the task, where the router reads the engines' API keys"
  default     = "http://127.0.0.1:4646"
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

variable "shutdown_delay" {
  type        = string
  description = "Time between leaving Consul and the stop signal, so clients stop picking this router"
  default     = "15s"
}

variable "kill_timeout" {
  type        = string
  description = "Time a stopping router gets to finish in-flight streams; capped by the client's max_kill_timeout"
  default     = "120s"
}

variable "cpu" {
  type        = number
  description = "CPU of each router, in MHz"
  default     = 1000
}

variable "memory" {
  type        = number
  description = "Memory of each router, in MiB"
  default     = 512
}

job "caravan-router" {
  type        = "system"
  region      = var.region
  namespace   = var.namespace
  datacenters = var.datacenters
  # Above model replicas (50): the endpoint clients use is placed first.
  priority = 70

  # Without a node class, every node runs a router.
  dynamic "constraint" {
    for_each = var.node_class == "" ? [] : [var.node_class]

    content {
      attribute = "${node.class}"
      value     = constraint.value
    }
  }

  update {
    max_parallel     = 1
    stagger          = "30s"
    min_healthy_time = "10s"
    healthy_deadline = "2m"
  }

  group "router" {
    # Consul drops this router from DNS and health answers first; the router
    # gets the stop signal only after this delay, then drains its streams.
    shutdown_delay = var.shutdown_delay

    network {
      port "http" {
        static = var.http_port
      }
    }

    service {
      name     = "caravan-router"
      port     = "http"
      provider = "consul"
      # Never the tag `caravan`: the routers discover model replicas by it.
      tags = ["caravan-control", "router"]

      check {
        name     = "caravan-router health"
        type     = "http"
        path     = "/health"
        interval = "5s"
        timeout  = "2s"

        check_restart {
          limit = 3
          grace = "30s"
        }
      }
    }

    restart {
      attempts = 5
      interval = "5m"
      delay    = "10s"
      mode     = "delay"
    }

    task "router" {
      driver       = "docker"
      kill_timeout = var.kill_timeout

      config {
        image = var.image
        # The host network reaches the node's own Consul agent on 127.0.0.1,
        # where Consul listens by default.
        network_mode = "host"
        args = [
          "router",
          "--host", "${NOMAD_IP_http}",
          "--port", "${NOMAD_PORT_http}",
          "--kv-prefix", var.kv_prefix,
        ]
      }

      # Nomad registers the caravan-router service (below), so the router must
      # not register a second instance of itself; and it may take most of the
      # kill_timeout to let in-flight streams finish on shutdown.
      env {
        CONSUL_HTTP_ADDR                  = var.consul_addr
        NOMAD_ADDR                        = var.nomad_addr
        CARAVAN_ROUTER_REGISTER_SERVICE   = "false"
        CARAVAN_ROUTER_SHUTDOWN_TIMEOUT_S = "100"
      }

      # The Consul token, optional API keys (comma-separated), CA certificates
      # (TLS) and client certificates and keys (mutual TLS) from the Nomad
      # Variable `nomad/jobs/caravan-router`. Keys: consul_token, api_keys,
      # nomad_token (reads the engines' API keys), consul_cacert, nomad_cacert,
      # nomad_client_cert, nomad_client_key, consul_client_cert,
      # consul_client_key; each one is optional (a client certificate goes
      # with its key).
      template {
        destination = "secrets/caravan.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-router" -}}
        {{ with nomadVar "nomad/jobs/caravan-router" -}}
        {{ with .consul_token.Value }}CONSUL_HTTP_TOKEN={{ . }}{{ end }}
        {{ with .api_keys.Value }}CARAVAN_ROUTER_API_KEYS={{ . }}{{ end }}
        {{ with .nomad_token.Value }}NOMAD_TOKEN={{ . }}{{ end }}
        {{ with .consul_cacert.Value }}CONSUL_CACERT={{ env "NOMAD_SECRETS_DIR" }}/consul-ca.pem{{ end }}
        {{ with .nomad_cacert.Value }}NOMAD_CACERT={{ env "NOMAD_SECRETS_DIR" }}/nomad-ca.pem{{ end }}
        {{ with .nomad_client_cert.Value }}NOMAD_CLIENT_CERT={{ env "NOMAD_SECRETS_DIR" }}/nomad-client.pem{{ end }}
        {{ with .nomad_client_key.Value }}NOMAD_CLIENT_KEY={{ env "NOMAD_SECRETS_DIR" }}/nomad-client-key.pem{{ end }}
        {{ with .consul_client_cert.Value }}CONSUL_CLIENT_CERT={{ env "NOMAD_SECRETS_DIR" }}/consul-client.pem{{ end }}
        {{ with .consul_client_key.Value }}CONSUL_CLIENT_KEY={{ env "NOMAD_SECRETS_DIR" }}/consul-client-key.pem{{ end }}
        {{- end }}
        {{- end }}
        EOT
      }

      template {
        destination = "secrets/consul-ca.pem"
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-router" }}{{ with nomadVar "nomad/jobs/caravan-router" }}{{ .consul_cacert.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nomad-ca.pem"
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-router" }}{{ with nomadVar "nomad/jobs/caravan-router" }}{{ .nomad_cacert.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nomad-client.pem"
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-router" }}{{ with nomadVar "nomad/jobs/caravan-router" }}{{ .nomad_client_cert.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nomad-client-key.pem"
        change_mode = "restart"
        perms       = "0400"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-router" }}{{ with nomadVar "nomad/jobs/caravan-router" }}{{ .nomad_client_key.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/consul-client.pem"
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-router" }}{{ with nomadVar "nomad/jobs/caravan-router" }}{{ .consul_client_cert.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/consul-client-key.pem"
        change_mode = "restart"
        perms       = "0400"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-router" }}{{ with nomadVar "nomad/jobs/caravan-router" }}{{ .consul_client_key.Value }}{{ end }}{{ end }}
        EOT
      }

      # The Vault alternative, where the token lives in Vault's KV v2 instead:
      #
      # vault {}
      #
      # template {
      #   destination = "secrets/caravan.env"
      #   env         = true
      #   change_mode = "restart"
      #   data        = <<-EOT
      #   {{ with secret "secret/data/caravan/router" -}}
      #   CONSUL_HTTP_TOKEN={{ .Data.data.consul_token }}
      #   {{- end }}
      #   EOT
      # }

      resources {
        cpu    = var.cpu
        memory = var.memory
      }
    }
  }
}
