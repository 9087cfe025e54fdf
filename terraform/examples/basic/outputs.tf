output "router_dns_name" {
  description = "Consul DNS name clients resolve to reach a router."
  value       = module.caravan.router_dns_name
}

output "model_keys" {
  description = "Consul KV key of each declared model, by model name."
  value       = module.caravan.model_keys
}
