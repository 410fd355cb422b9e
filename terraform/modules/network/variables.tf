variable "name" {
  description = "Prefix for the Name tag of everything this module creates."
  type        = string
}

variable "create_vpc" {
  description = "Create a new VPC with one subnet (true), or use existing_vpc_id and existing_subnet_id (false)."
  type        = bool
  default     = true
}

variable "region" {
  description = "Region of the provider; availability_zone must be one of its zones."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9]$", var.region))
    error_message = "The region must be a Region name such as \"us-east-2\"."
  }
}

variable "availability_zone" {
  description = "The one Availability Zone of the cluster (EFA traffic does not cross subnets, so every node lives in one subnet of one AZ). Pick the AZ that holds your capacity."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-gov)?-[a-z]+-[0-9][a-z]$", var.availability_zone))
    error_message = "The availability_zone must be an AZ name such as \"us-east-2b\", not a Region or an AZ ID."
  }
}

variable "vpc_cidr" {
  description = "CIDR block of the new VPC (create_vpc = true)."
  type        = string
  default     = "10.42.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0))
    error_message = "The vpc_cidr must be a valid IPv4 CIDR block, e.g. \"10.42.0.0/16\"."
  }
}

variable "subnet_cidr" {
  description = "CIDR block of the cluster subnet (create_vpc = true). A p5en node uses 17 addresses (one per interface), so keep it at /24 or larger."
  type        = string
  default     = "10.42.0.0/20"

  validation {
    condition     = can(cidrhost(var.subnet_cidr, 0)) && tonumber(split("/", var.subnet_cidr)[1]) <= 24
    error_message = "The subnet_cidr must be a valid IPv4 CIDR block of /24 or larger (each EFA node takes one address per interface)."
  }
}

variable "nat_gateway" {
  description = "Keep the cluster subnet private and give it internet egress through a NAT gateway (create_vpc = true). false: route the cluster subnet straight to the internet gateway (for nodes with Elastic IPs)."
  type        = bool
  default     = true
}

variable "nat_subnet_cidr" {
  description = "CIDR block of the small public subnet that holds the NAT gateway (create_vpc and nat_gateway); inside vpc_cidr, outside subnet_cidr."
  type        = string
  default     = "10.42.255.0/28"

  validation {
    condition     = can(cidrhost(var.nat_subnet_cidr, 0))
    error_message = "The nat_subnet_cidr must be a valid IPv4 CIDR block, e.g. \"10.42.255.0/28\"."
  }
}

variable "existing_vpc_id" {
  description = "VPC to use when create_vpc = false."
  type        = string
  default     = ""

  validation {
    condition     = var.existing_vpc_id == "" || can(regex("^vpc-[0-9a-f]{8,17}$", var.existing_vpc_id))
    error_message = "The existing_vpc_id must be empty or a VPC ID such as \"vpc-0123456789abcdef0\"."
  }
}

variable "existing_subnet_id" {
  description = "Subnet to use when create_vpc = false. It must be in availability_zone and route to the internet (NAT or IGW) for the node set-up to download packages."
  type        = string
  default     = ""

  validation {
    condition     = var.existing_subnet_id == "" || can(regex("^subnet-[0-9a-f]{8,17}$", var.existing_subnet_id))
    error_message = "The existing_subnet_id must be empty or a subnet ID such as \"subnet-0123456789abcdef0\"."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
