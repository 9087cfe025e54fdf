output "scheduler_job_id" {
  description = "Nomad job ID of the scheduler."
  value       = nomad_job.scheduler.id
}

output "router_job_id" {
  description = "Nomad job ID of the router system job."
  value       = nomad_job.router.id
}

output "router_dns_name" {
  description = "Consul DNS name clients resolve to reach a router (A and SRV records)."
  value       = "caravan-router.service.consul"
}

output "model_keys" {
  description = "Consul KV key of each declared model, by model name."
  value       = { for name, model in consul_keys.models : name => "${var.kv_prefix}models/${name}" }
}
