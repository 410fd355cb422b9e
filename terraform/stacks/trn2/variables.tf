variable "region" {
  description = "AWS Region of the cluster."
  type        = string
  default     = "us-east-2"
}

variable "availability_zone" {
  description = "The one AZ of the cluster: where your trn2.48xlarge capacity is."
  type        = string
}

variable "name" {
  description = "Cluster name (the kvpush:cluster tag)."
  type        = string
  default     = "kvpush-trn2"
}

variable "client_cidrs" {
  description = "Networks allowed to SSH to the nodes and to reach the proxy port."
  type        = list(string)
}

variable "ssh_key_name" {
  description = "EC2 key pair name; empty to rely on SSM Session Manager."
  type        = string
  default     = ""
}

variable "prefill_count" {
  description = "Number of prefill nodes."
  type        = number
  default     = 1
}

variable "decode_count" {
  description = "Number of decode nodes."
  type        = number
  default     = 1
}

variable "capacity" {
  description = "Capacity source: { type = \"on-demand\" | \"odcr\" | \"capacity-block\", reservation_id = \"cr-...\" }."
  type = object({
    type           = string
    reservation_id = optional(string, "")
  })
  default = {
    type = "on-demand"
  }
}

variable "existing_placement_group" {
  description = "Cluster placement group that an On-Demand Capacity Reservation lives in; empty to create one."
  type        = string
  default     = ""
}

variable "existing_vpc_id" {
  description = "Use this VPC instead of creating one (with existing_subnet_id)."
  type        = string
  default     = ""
}

variable "existing_subnet_id" {
  description = "Use this subnet instead of creating a VPC; it must be in availability_zone."
  type        = string
  default     = ""
}

variable "model" {
  description = "Model served by the prefill and decode engines."
  type        = string
  default     = "Qwen/Qwen3-32B"
}

variable "tp_size" {
  description = "Tensor-parallel size; 0 for every accelerator of a node."
  type        = number
  default     = 0
}

variable "kvpush_repo_url" {
  description = "Git URL the nodes clone kvpush from."
  type        = string
}

variable "kvpush_ref" {
  description = "Release tag of kvpush that the nodes install (v0.2.0; CHANGELOG.md lists the releases). Never a branch or an arbitrary commit: a branch moves, and nodes started a day apart would run different code; the node set-up checks that the installed kvpush reports this version."
  type        = string

  validation {
    condition     = can(regex("^v[0-9]+\\.[0-9]+\\.[0-9]+(-rc[0-9]+)?$", var.kvpush_ref))
    error_message = "The kvpush_ref must be a release tag such as \"v0.2.0\", not a branch or a commit."
  }
}

variable "results_bucket" {
  description = "Existing S3 bucket for results (`kvpush cluster upload`); empty for none."
  type        = string
  default     = ""
}

variable "tags" {
  description = "Extra tags on every resource."
  type        = map(string)
  default     = {}
}

variable "public_ips" {
  description = "Give the nodes public addresses (Elastic IPs on the accelerated nodes). Off by default: nodes are private, reached with SSM Session Manager, and reach the internet through a NAT gateway."
  type        = bool
  default     = false
}

variable "efa_installer_sha256" {
  description = "SHA-256 of aws-efa-installer-<efa_installer_version>.tar.gz, as AWS publishes it. A node whose AMI lacks EFA downloads the installer and runs it as root only if it matches; empty: such a node refuses to install it (the DLAMIs ship EFA, so this is needed only with another AMI)."
  type        = string
  default     = ""

  validation {
    condition     = var.efa_installer_sha256 == "" || can(regex("^[0-9a-f]{64}$", var.efa_installer_sha256))
    error_message = "The efa_installer_sha256 must be empty or 64 lowercase hex digits."
  }
}

variable "ami_id" {
  description = "AMI of the accelerated nodes, pinned (empty: ami_ssm_parameter, or the floating DLAMI parameter with allow_latest_ami)."
  type        = string
  default     = ""
}

variable "proxy_ami_id" {
  description = "AMI of the proxy node, pinned (empty: proxy_ami_ssm_parameter, or Canonical's current Ubuntu with allow_latest_ami)."
  type        = string
  default     = ""
}

variable "ami_ssm_parameter" {
  description = "A versioned SSM parameter naming the accelerated nodes' AMI (empty: the instance profile's floating one)."
  type        = string
  default     = ""
}

variable "proxy_ami_ssm_parameter" {
  description = "A dated SSM parameter naming the proxy node's AMI (empty: Canonical's floating one)."
  type        = string
  default     = ""
}

variable "allow_latest_ami" {
  description = "Accept floating (latest/current) AMIs; off: pin them (ami_id, proxy_ami_id or versioned SSM parameters)."
  type        = bool
  default     = false
}
