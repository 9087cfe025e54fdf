variable "image" {
  description = "caravan container image the scheduler and router jobs run (built from the repository's Dockerfile)."
  type        = string
  default     = "caravan:0.1.0"
}

variable "datacenters" {
  description = "Nomad datacenters the scheduler and router may run in."
  type        = list(string)
  default     = ["*"]
}

variable "namespace" {
  description = "Nomad namespace of caravan's jobs; the scheduler submits replica jobs to it too."
  type        = string
  default     = "default"
}

variable "region" {
  description = "Nomad region of caravan's jobs."
  type        = string
  default     = "global"
}

variable "kv_prefix" {
  description = "Consul KV prefix of caravan's state (models, desired counts, leader lock); ends with a slash."
  type        = string
  default     = "caravan/"

  validation {
    condition     = trimsuffix(var.kv_prefix, "/") != var.kv_prefix && trimprefix(var.kv_prefix, "/") == var.kv_prefix
    error_message = "The kv_prefix must end with a slash and must not start with one, like \"caravan/\"."
  }
}

variable "nomad_addr" {
  description = "Nomad HTTP API address as the scheduler task sees it (it uses the host network)."
  type        = string
  default     = "http://127.0.0.1:4646"
}

variable "consul_addr" {
  description = "Consul HTTP API address as the scheduler and router tasks see it (the node's own agent by default)."
  type        = string
  default     = "http://127.0.0.1:8500"
}

variable "cluster_config" {
  description = "Cluster config YAML for the scheduler (datacenters, namespace, images, GPU classes of the replica jobs); \"{}\" keeps the defaults."
  type        = string
  default     = "{}"
}

variable "scheduler_count" {
  description = "Scheduler instances; one leads through a Consul lock, the others stand by."
  type        = number
  default     = 2

  validation {
    condition     = var.scheduler_count >= 1
    error_message = "The scheduler_count must be at least 1."
  }
}

variable "scheduler_cpu" {
  description = "CPU of each scheduler instance, in MHz."
  type        = number
  default     = 500
}

variable "scheduler_memory" {
  description = "Memory of each scheduler instance, in MiB."
  type        = number
  default     = 256
}

variable "router_node_class" {
  description = "Run routers only on Nomad nodes of this node class; empty runs one on every node."
  type        = string
  default     = ""
}

variable "router_http_port" {
  description = "Static port every router listens on; 0 lets Nomad pick a port per node (clients then need Consul DNS SRV records)."
  type        = number
  default     = 8080

  validation {
    condition     = var.router_http_port >= 0 && var.router_http_port <= 65535
    error_message = "The router_http_port must be between 0 and 65535."
  }
}

variable "router_shutdown_delay" {
  description = "Time between a stopping router leaving Consul and its stop signal, as a Nomad duration."
  type        = string
  default     = "15s"
}

variable "router_kill_timeout" {
  description = "Time a stopping router gets to finish in-flight streams, as a Nomad duration; capped by the clients' max_kill_timeout."
  type        = string
  default     = "120s"
}

variable "router_cpu" {
  description = "CPU of each router, in MHz."
  type        = number
  default     = 1000
}

variable "router_memory" {
  description = "Memory of each router, in MiB."
  type        = number
  default     = 512
}

variable "profile_files" {
  description = "Paths of model profile files (YAML or JSON); each becomes the Consul KV entry <kv_prefix>models/<name>."
  type        = list(string)
  default     = []
}

variable "purge_on_destroy" {
  description = "Purge caravan's jobs from Nomad on destroy instead of only stopping them."
  type        = bool
  default     = false
}

variable "manage_acl_policies" {
  description = "Create the least-privilege Consul and Nomad ACL policies of the scheduler, the router and model operators (policies/); tokens are left to you."
  type        = bool
  default     = false
}
