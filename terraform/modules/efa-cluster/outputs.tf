locals {
  prefill_ips = [for key, node in local.accelerated_nodes : aws_instance.accelerated[key].private_ip if node.role == "prefill"]
  decode_ips  = [for key, node in local.accelerated_nodes : aws_instance.accelerated[key].private_ip if node.role == "decode"]
  proxy_ip    = var.create_proxy_node ? aws_instance.proxy[0].private_ip : ""
}

output "cluster_name" {
  description = "Value of the kvpush:cluster tag on every node (what `kvpush cluster --name` takes)."
  value       = var.name
}

output "instance_profile" {
  description = "The instance profile entry the accelerated nodes were built from."
  value       = merge(local.profile, { instance_type = var.instance_type })
}

output "network_interfaces" {
  description = "Network interfaces of each accelerated node (card, device index, type)."
  value       = local.network_interfaces
}

output "placement_group" {
  description = "Cluster placement group of the accelerated nodes, or null."
  value       = local.placement_group_name
}

output "security_group_id" {
  description = "The self-referencing cluster security group."
  value       = aws_security_group.cluster.id
}

output "nodes" {
  description = "Every node by name: role, instance id, private and public IP."
  value = merge(
    { for key, node in local.accelerated_nodes : key => {
      role        = node.role
      instance_id = aws_instance.accelerated[key].id
      private_ip  = aws_instance.accelerated[key].private_ip
      public_ip   = var.assign_public_ips ? aws_eip.accelerated[key].public_ip : ""
    } },
    var.create_proxy_node ? { "proxy-0" = {
      role        = "proxy"
      instance_id = aws_instance.proxy[0].id
      private_ip  = aws_instance.proxy[0].private_ip
      public_ip   = aws_instance.proxy[0].public_ip
    } } : {},
  )
}

output "prefill_private_ips" {
  description = "Private IPs of the prefill nodes."
  value       = local.prefill_ips
}

output "decode_private_ips" {
  description = "Private IPs of the decode nodes."
  value       = local.decode_ips
}

output "proxy_public_ip" {
  description = "Public IP of the proxy/bench node (empty without one)."
  value       = var.create_proxy_node ? aws_instance.proxy[0].public_ip : ""
}

output "cluster_env" {
  description = "The cluster env file the run scripts read (the same keys `kvpush cluster env` writes)."
  value       = <<-EOT
    KVPUSH_CLUSTER=${var.name}
    PREFILL_HOST=${local.prefill_ips[0]}
    DECODE_HOST=${local.decode_ips[0]}
    PROXY_HOST=${local.proxy_ip}
    PREFILL_HOSTS=${join(",", local.prefill_ips)}
    DECODE_HOSTS=${join(",", local.decode_ips)}
    PROXY_PORT=${var.ports.proxy}
    PREFILL_PORT=${var.ports.prefill}
    DECODE_PORT=${var.ports.decode}
    SIDE_CHANNEL_PORT=${var.ports.side_channel}
    PREFILL_TP_SIZE=${local.tp_size}
    PREFILL_PP_SIZE=1
    MODEL=${var.model}
    MAX_MODEL_LEN=${var.max_model_len}
    KV_BUFFER_DEVICE=${local.profile.kv_buffer_device}
  EOT
}

output "hmac_key_secret_arn" {
  description = "The Secrets Manager secret holding the shared HMAC key (the ARN, not the key): `kvpush cluster key --secret-id` copies it to a 0600 file."
  value       = aws_secretsmanager_secret.hmac_key.arn
}

output "setup_scripts" {
  description = "The rendered set-up script of each role (what cloud-init runs), for review."
  value       = local.setup_scripts
}
