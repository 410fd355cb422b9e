output "cluster_name" {
  description = "The kvpush:cluster tag value."
  value       = module.cluster.cluster_name
}

output "nodes" {
  description = "Every node: role, instance id, private and public IP."
  value       = module.cluster.nodes
}

output "proxy_public_ip" {
  description = "Where to SSH to run the proxy and the sweep."
  value       = module.cluster.proxy_public_ip
}

output "network_interfaces" {
  description = "Interfaces of each accelerated node."
  value       = module.cluster.network_interfaces
}

output "placement_group" {
  description = "Placement group of the accelerated nodes."
  value       = module.cluster.placement_group
}

output "cluster_env" {
  description = "Env file for scripts/serve_pd.sh and scripts/run_sweep.sh (`terraform output -raw cluster_env > cluster.env`)."
  value       = "KVPUSH_REGION=${var.region}\n${module.cluster.cluster_env}"
}

output "hmac_key_secret_arn" {
  description = "Secret holding the shared HMAC key (the ARN only): the nodes copy it to /etc/kvpush/hmac.key; elsewhere `kvpush cluster key --secret-id ARN --output FILE`."
  value       = module.cluster.hmac_key_secret_arn
}
