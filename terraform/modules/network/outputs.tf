output "vpc_id" {
  description = "The cluster VPC."
  value       = var.create_vpc ? aws_vpc.this[0].id : var.existing_vpc_id
}

output "subnet_id" {
  description = "The single subnet every node and every network interface of the cluster uses."
  value       = var.create_vpc ? aws_subnet.cluster[0].id : data.aws_subnet.existing[0].id
}

output "availability_zone" {
  description = "The cluster's Availability Zone."
  value       = var.availability_zone
}

output "has_internet_gateway" {
  description = "Whether the cluster subnet routes straight to an internet gateway this module created (so Elastic IPs on the nodes are reachable)."
  value       = var.create_vpc && !var.nat_gateway
}
