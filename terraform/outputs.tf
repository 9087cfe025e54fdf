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

output "acl_policy_names" {
  description = "Names of the ACL policies created when manage_acl_policies is true, by system and component."
  value = {
    consul = { for k, p in consul_acl_policy.caravan : k => p.name }
    nomad  = { for k, p in nomad_acl_policy.caravan : k => p.name }
  }
}
