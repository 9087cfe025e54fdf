# caravan scheduler: the control plane that turns model profiles (Consul KV
# `<kv_prefix>models/<name>`) into one Nomad job per replica.
#
# Several instances run at once; one leads through a Consul session lock on
# `<kv_prefix>leader` and the others wait, so a lost node costs one failover,
# never a gap in reconciliation.
#
# Tokens come from the Nomad Variable `nomad/jobs/caravan-scheduler` (in the
# job's namespace), which only this job's tasks can read; see
# jobspecs/README.md for `nomad var put`. Nothing secret is passed as a job
# variable, so nothing secret ends up in the job's stored specification.

variable "image" {
  type        = string
  description = "caravan container image (built from the repository's Dockerfile)"
  default     = "caravan:0.1.0"
}

variable "datacenters" {
  type        = list(string)
  description = "Datacenters the scheduler may run in"
  default     = ["*"]
}

variable "namespace" {
  type        = string
  description = "Nomad namespace of this job and of the replica jobs it submits"
  default     = "default"
}

variable "region" {
  type        = string
  description = "Nomad region of this job and of the replica jobs it submits"
  default     = "global"
}

variable "count" {
  type        = number
  description = "Scheduler instances; one leads, the others stand by"
  default     = 2
}

variable "nomad_addr" {
  type        = string
  description = "Nomad HTTP API address as seen from the task (the task uses the host network)"
  default     = "http://127.0.0.1:4646"
}

variable "consul_addr" {
  type        = string
  description = "Consul HTTP API address as seen from the task (the local agent by default)"
  default     = "http://127.0.0.1:8500"
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

variable "cluster_config" {
  type        = string
  description = "Cluster config YAML (datacenters, images, GPU classes) for the replica jobs"
  default     = "{}"
}

variable "cpu" {
  type        = number
  description = "CPU of each scheduler instance, in MHz"
  default     = 500
}

variable "memory" {
  type        = number
  description = "Memory of each scheduler instance, in MiB"
  default     = 256
}

job "caravan-scheduler" {
  type        = "service"
  region      = var.region
  namespace   = var.namespace
  datacenters = var.datacenters
  # Above model replicas (50): when the cluster is full, the control plane
  # is placed first.
  priority = 70

  update {
    max_parallel      = 1
    health_check      = "checks"
    min_healthy_time  = "10s"
    healthy_deadline  = "3m"
    progress_deadline = "10m"
    auto_revert       = true
  }

  group "scheduler" {
    count = var.count

    # Standbys on other nodes than the leader, while other nodes exist.
    spread {
      attribute = "${node.unique.id}"
      weight    = 100
    }

    network {
      port "http" {}
    }

    service {
      name     = "caravan-scheduler"
      port     = "http"
      provider = "consul"
      # Never the tag `caravan`: the routers discover model replicas by it.
      tags = ["caravan-control", "scheduler"]

      check {
        name     = "caravan-scheduler health"
        type     = "http"
        path     = "/health"
        interval = "10s"
        timeout  = "2s"

        check_restart {
          limit = 3
          grace = "30s"
        }
      }
    }

    restart {
      attempts = 3
      interval = "5m"
      delay    = "15s"
      mode     = "delay"
    }

    reschedule {
      delay          = "30s"
      delay_function = "exponential"
      max_delay      = "5m"
      unlimited      = true
    }

    task "scheduler" {
      driver = "docker"
      # Long enough to release the leader lock, so a standby takes over
      # at once instead of waiting for the session to expire.
      kill_timeout = "20s"

      config {
        image = var.image
        # The host network reaches the node's own Nomad and Consul agents
        # on 127.0.0.1, where Consul listens by default.
        network_mode = "host"
        args = [
          "scheduler",
          "--http-host", "${NOMAD_IP_http}",
          "--http-port", "${NOMAD_PORT_http}",
          "--kv-prefix", var.kv_prefix,
          "--cluster-config", "${NOMAD_TASK_DIR}/cluster.yaml",
        ]
      }

      # No NOMAD_NAMESPACE here: Nomad gives the task its job's namespace, so the
      # scheduler submits and reads the replica jobs where it runs itself, even
      # when `nomad job run -namespace` (or NOMAD_NAMESPACE) put the job
      # elsewhere than var.namespace says.
      env {
        NOMAD_ADDR       = var.nomad_addr
        NOMAD_REGION     = var.region
        CONSUL_HTTP_ADDR = var.consul_addr
      }

      # Tokens (and CA certificates, for TLS; client certificates and keys,
      # for mutual TLS) from the Nomad Variable `nomad/jobs/caravan-scheduler`.
      # Keys: nomad_token, consul_token, nomad_cacert, consul_cacert,
      # nomad_client_cert, nomad_client_key, consul_client_cert,
      # consul_client_key, api_tokens; each one is optional (a client
      # certificate goes with its key), but
      # without api_tokens the scheduler's API listens on 127.0.0.1 only (and
      # the health check on the node address fails): see docs/security.md.
      template {
        destination = "secrets/caravan.env"
        env         = true
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-scheduler" -}}
        {{ with nomadVar "nomad/jobs/caravan-scheduler" -}}
        {{ with .nomad_token.Value }}NOMAD_TOKEN={{ . }}{{ end }}
        {{ with .consul_token.Value }}CONSUL_HTTP_TOKEN={{ . }}{{ end }}
        {{ with .nomad_cacert.Value }}NOMAD_CACERT={{ env "NOMAD_SECRETS_DIR" }}/nomad-ca.pem{{ end }}
        {{ with .consul_cacert.Value }}CONSUL_CACERT={{ env "NOMAD_SECRETS_DIR" }}/consul-ca.pem{{ end }}
        {{ with .nomad_client_cert.Value }}NOMAD_CLIENT_CERT={{ env "NOMAD_SECRETS_DIR" }}/nomad-client.pem{{ end }}
        {{ with .nomad_client_key.Value }}NOMAD_CLIENT_KEY={{ env "NOMAD_SECRETS_DIR" }}/nomad-client-key.pem{{ end }}
        {{ with .consul_client_cert.Value }}CONSUL_CLIENT_CERT={{ env "NOMAD_SECRETS_DIR" }}/consul-client.pem{{ end }}
        {{ with .consul_client_key.Value }}CONSUL_CLIENT_KEY={{ env "NOMAD_SECRETS_DIR" }}/consul-client-key.pem{{ end }}
        {{ with .api_tokens.Value }}CARAVAN_SCHEDULER_API_TOKENS_FILE={{ env "NOMAD_SECRETS_DIR" }}/api-tokens{{ end }}
        {{- end }}
        {{- end }}
        EOT
      }

      template {
        destination = "secrets/nomad-ca.pem"
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-scheduler" }}{{ with nomadVar "nomad/jobs/caravan-scheduler" }}{{ .nomad_cacert.Value }}{{ end }}{{ end }}
        EOT
      }

      # The API's bearer tokens, one per line. The scheduler re-reads the file
      # when it changes, so rotating them needs no restart (docs/security.md).
      template {
        destination = "secrets/api-tokens"
        change_mode = "noop"
        perms       = "0400"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-scheduler" }}{{ with nomadVar "nomad/jobs/caravan-scheduler" }}{{ .api_tokens.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/consul-ca.pem"
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-scheduler" }}{{ with nomadVar "nomad/jobs/caravan-scheduler" }}{{ .consul_cacert.Value }}{{ end }}{{ end }}
        EOT
      }

      # Client certificates and keys for clusters that verify clients (mTLS).
      template {
        destination = "secrets/nomad-client.pem"
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-scheduler" }}{{ with nomadVar "nomad/jobs/caravan-scheduler" }}{{ .nomad_client_cert.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/nomad-client-key.pem"
        change_mode = "restart"
        perms       = "0400"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-scheduler" }}{{ with nomadVar "nomad/jobs/caravan-scheduler" }}{{ .nomad_client_key.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/consul-client.pem"
        change_mode = "restart"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-scheduler" }}{{ with nomadVar "nomad/jobs/caravan-scheduler" }}{{ .consul_client_cert.Value }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/consul-client-key.pem"
        change_mode = "restart"
        perms       = "0400"
        data        = <<-EOT
        {{ if nomadVarExists "nomad/jobs/caravan-scheduler" }}{{ with nomadVar "nomad/jobs/caravan-scheduler" }}{{ .consul_client_key.Value }}{{ end }}{{ end }}
        EOT
      }

      # The Vault alternative, where tokens live in Vault's KV v2 instead:
      #
      # vault {}
      #
      # template {
      #   destination = "secrets/caravan.env"
      #   env         = true
      #   change_mode = "restart"
      #   data        = <<-EOT
      #   {{ with secret "secret/data/caravan/scheduler" -}}
      #   NOMAD_TOKEN={{ .Data.data.nomad_token }}
      #   CONSUL_HTTP_TOKEN={{ .Data.data.consul_token }}
      #   {{- end }}
      #   EOT
      # }
      #
      # The workload-identity alternative for the Nomad API: drop nomad_token
      # from the variable, attach the scheduler's ACL policy to this job
      # (`nomad acl policy apply -namespace <ns> -job caravan-scheduler ...`),
      # and let Nomad put the task's identity in NOMAD_TOKEN:
      #
      # identity {
      #   env = true
      # }

      template {
        destination = "local/cluster.yaml"
        change_mode = "restart"
        data        = var.cluster_config
      }

      resources {
        cpu    = var.cpu
        memory = var.memory
      }
    }
  }
}
