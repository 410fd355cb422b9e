variable "region" {
  description = "AWS Region of the cluster."
  type        = string
  default     = "us-east-2"
}

variable "availability_zone" {
  description = "The one AZ of the cluster: where your p5en.48xlarge capacity is."
  type        = string
}

variable "name" {
  description = "Cluster name (the kvpush:cluster tag)."
  type        = string
  default     = "kvpush-p5en"
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
  description = "Branch, tag or commit of kvpush."
  type        = string
  default     = "main"
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
