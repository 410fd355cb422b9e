variable "name" {
  description = "Cluster name. Prefixes resource names and is the value of the kvpush:cluster tag that `kvpush cluster` looks for."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,28}[a-z0-9]$", var.name))
    error_message = "The name must be 3-30 characters of lower-case letters, digits and hyphens, starting with a letter (it becomes part of IAM and placement group names)."
  }
}

variable "instance_type" {
  description = "Accelerated instance type of the prefill and decode nodes."
  type        = string

  validation {
    # Keep in step with local.instance_profiles (a validation block cannot read locals on Terraform < 1.9).
    condition     = contains(["p5en.48xlarge", "trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"], var.instance_type)
    error_message = "The instance_type must be one of p5en.48xlarge, trn1.32xlarge, trn1n.32xlarge, trn2.48xlarge (the types with an entry in instance_profiles.tf)."
  }
}

variable "vpc_id" {
  description = "VPC of the cluster (the network module's vpc_id output)."
  type        = string
}

variable "subnet_id" {
  description = "The one subnet of the cluster: every node and every network interface goes here, since EFA traffic does not cross subnets."
  type        = string
}

variable "prefill_count" {
  description = "Number of prefill nodes."
  type        = number
  default     = 1

  validation {
    condition     = var.prefill_count >= 1 && var.prefill_count <= 8 && floor(var.prefill_count) == var.prefill_count
    error_message = "The prefill_count must be a whole number from 1 to 8."
  }
}

variable "decode_count" {
  description = "Number of decode nodes."
  type        = number
  default     = 1

  validation {
    condition     = var.decode_count >= 1 && var.decode_count <= 8 && floor(var.decode_count) == var.decode_count
    error_message = "The decode_count must be a whole number from 1 to 8."
  }
}

variable "create_proxy_node" {
  description = "Create the small node that runs `kvpush proxy` and the load generator."
  type        = bool
  default     = true
}

variable "proxy_instance_type" {
  description = "Instance type of the proxy/bench node (no accelerator, no EFA)."
  type        = string
  default     = "m7i.4xlarge"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]*\\.[a-z0-9]+$", var.proxy_instance_type))
    error_message = "The proxy_instance_type must look like \"m7i.4xlarge\"."
  }
}

variable "client_cidrs" {
  description = "CIDR blocks allowed to reach the nodes over SSH and the proxy port (your workstation, a bastion). Never 0.0.0.0/0."
  type        = list(string)

  validation {
    condition     = length(var.client_cidrs) > 0 && alltrue([for c in var.client_cidrs : can(cidrhost(c, 0))])
    error_message = "The client_cidrs must hold at least one valid IPv4 CIDR block, e.g. [\"203.0.113.7/32\"]."
  }

  validation {
    condition     = !contains(var.client_cidrs, "0.0.0.0/0")
    error_message = "The client_cidrs must not contain 0.0.0.0/0: SSH and the proxy would be open to the internet."
  }

  # 0.0.0.0/1 or 0.0.0.0/2 are the internet by another name: a block wider than a /16 (a site's range) is
  # refused, and so is one whose address has host bits set (cidrhost(c, 0) is the block's own address)
  validation {
    condition = alltrue([
      for c in var.client_cidrs : can(cidrnetmask(c)) && tonumber(split("/", c)[1]) >= 16 && cidrhost(c, 0) == split("/", c)[0]
    ])
    error_message = "Each client_cidrs block must be a /16 or narrower, written with its network address (e.g. \"203.0.113.0/24\", not \"0.0.0.0/1\")."
  }
}

variable "ssh_key_name" {
  description = "EC2 key pair for SSH as the ubuntu user. Empty: no key (use SSM Session Manager, see enable_ssm)."
  type        = string
  default     = ""
}

variable "enable_ssm" {
  description = "Attach AmazonSSMManagedInstanceCore to the node role so that `aws ssm start-session` works without SSH."
  type        = bool
  default     = true
}

variable "assign_public_ips" {
  description = "Give every node a public address (an Elastic IP on the primary interface of the accelerated nodes, which cannot get an automatic one). Needs a subnet routed to an internet gateway. Off by default: reach the nodes with SSM Session Manager."
  type        = bool
  default     = false
}

variable "allow_internet_egress" {
  description = "Allow outbound traffic to the internet (package downloads during set-up). Node-to-node traffic is allowed by the self-referencing rules either way."
  type        = bool
  default     = true
}

variable "efa_interface_mode" {
  description = "\"efa-only\": ENA primary interface plus one EFA-only interface per network card (AWS provider >= 5.74, the current AWS recommendation). \"efa\": one EFA (with ENA) interface per network card, the older layout."
  type        = string
  default     = "efa-only"

  validation {
    condition     = contains(["efa-only", "efa"], var.efa_interface_mode)
    error_message = "The efa_interface_mode must be \"efa-only\" or \"efa\"."
  }
}

variable "use_placement_group" {
  description = "Launch the accelerated nodes into a cluster placement group (lowest latency between prefill and decode). Ignored for Capacity Blocks, which are co-located by AWS."
  type        = bool
  default     = true
}

variable "existing_placement_group" {
  description = "Name of an existing cluster placement group to use instead of creating one (e.g. the group your On-Demand Capacity Reservation was created in)."
  type        = string
  default     = ""
}

variable "capacity" {
  description = <<-EOT
    Where the accelerated nodes' capacity comes from:
    type = "on-demand" (default), "odcr" (an On-Demand Capacity Reservation) or "capacity-block"
    (an EC2 Capacity Block for ML); reservation_id = "cr-..." for the last two.
  EOT
  type = object({
    type           = string
    reservation_id = optional(string, "")
  })
  default = {
    type = "on-demand"
  }

  validation {
    condition     = contains(["on-demand", "odcr", "capacity-block"], var.capacity.type)
    error_message = "The capacity.type must be \"on-demand\", \"odcr\" or \"capacity-block\"."
  }

  validation {
    condition     = var.capacity.type == "on-demand" ? var.capacity.reservation_id == "" : can(regex("^cr-[0-9a-f]{8,17}$", var.capacity.reservation_id))
    error_message = "The capacity.reservation_id must be a reservation ID (\"cr-0123456789abcdef0\") when capacity.type is \"odcr\" or \"capacity-block\", and empty for \"on-demand\"."
  }
}

variable "ami_id" {
  description = "AMI of the accelerated nodes, pinned. Empty: ami_ssm_parameter, or (only with allow_latest_ami) the instance profile's \"latest\" SSM parameter (the AWS Deep Learning AMI for NVIDIA, the Neuron DLAMI for Trainium)."
  type        = string
  default     = ""

  validation {
    condition     = var.ami_id == "" || can(regex("^ami-[0-9a-f]{8,17}$", var.ami_id))
    error_message = "The ami_id must be empty or an AMI ID such as \"ami-0123456789abcdef0\"."
  }
}

variable "proxy_ami_id" {
  description = "AMI of the proxy node, pinned. Empty: proxy_ami_ssm_parameter, or (only with allow_latest_ami) Canonical's \"current\" Ubuntu 24.04 SSM parameter."
  type        = string
  default     = ""

  validation {
    condition     = var.proxy_ami_id == "" || can(regex("^ami-[0-9a-f]{8,17}$", var.proxy_ami_id))
    error_message = "The proxy_ami_id must be empty or an AMI ID such as \"ami-0123456789abcdef0\"."
  }
}

variable "ami_ssm_parameter" {
  description = "A pinned SSM parameter naming the accelerated nodes' AMI (a versioned DLAMI parameter). Empty: the instance profile's, which floats (\"latest\") and needs allow_latest_ami."
  type        = string
  default     = ""
}

variable "proxy_ami_ssm_parameter" {
  description = "A pinned SSM parameter naming the proxy node's AMI (e.g. a dated Canonical release). Empty: Canonical's \"current\", which floats and needs allow_latest_ami."
  type        = string
  default     = ""
}

variable "allow_latest_ami" {
  description = "Let an AMI float: resolve a \"latest\"/\"current\" SSM parameter at each plan, so nodes made a day apart may boot different images. Off: pin ami_id / proxy_ami_id or a versioned SSM parameter."
  type        = bool
  default     = false
}

variable "root_volume_size_gb" {
  description = "Root volume size of the accelerated nodes (model weights, vLLM, compile caches)."
  type        = number
  default     = 1000

  validation {
    condition     = var.root_volume_size_gb >= 200 && var.root_volume_size_gb <= 16384
    error_message = "The root_volume_size_gb must be between 200 and 16384 GiB."
  }
}

variable "kms_key_id" {
  description = "KMS key ARN for the encrypted root volumes. Empty: the account's default EBS key."
  type        = string
  default     = ""
}

variable "secrets_kms_key_id" {
  description = "KMS key ARN that encrypts the shared HMAC key's secret. Empty: the account's aws/secretsmanager key."
  type        = string
  default     = ""

  validation {
    condition     = var.secrets_kms_key_id == "" || can(regex("^arn:aws[a-z-]*:kms:", var.secrets_kms_key_id))
    error_message = "The secrets_kms_key_id must be empty or a KMS key ARN (the node role's kms:Decrypt grant names it)."
  }
}

variable "node_user" {
  description = "The login user that runs the engines on the nodes (owns the 0600 HMAC key file); the AMIs' default is ubuntu."
  type        = string
  default     = "ubuntu"

  validation {
    condition     = can(regex("^[a-z_][a-z0-9_-]{0,31}$", var.node_user))
    error_message = "The node_user must be a Linux user name."
  }
}

variable "ports" {
  description = "TCP ports: the proxy, the prefill and decode vLLM servers, and the first NIXL side-channel port (ranks add their offset)."
  type = object({
    proxy        = optional(number, 8000)
    prefill      = optional(number, 8100)
    decode       = optional(number, 8200)
    side_channel = optional(number, 5600)
  })
  default = {}

  validation {
    condition     = alltrue([for p in [var.ports.proxy, var.ports.prefill, var.ports.decode, var.ports.side_channel] : p >= 1024 && p <= 65000])
    error_message = "Every port must be between 1024 and 65000."
  }

  validation {
    condition     = length(distinct([var.ports.proxy, var.ports.prefill, var.ports.decode, var.ports.side_channel])) == 4
    error_message = "The proxy, prefill, decode and side_channel ports must all differ."
  }
}

variable "model" {
  description = "Model the run scripts serve (a Hugging Face id or a local path on the nodes)."
  type        = string
  default     = "Qwen/Qwen3-8B"
}

variable "tp_size" {
  description = "Tensor-parallel size of each engine. 0: the instance profile's default (all accelerators of one node)."
  type        = number
  default     = 0

  validation {
    condition     = var.tp_size >= 0 && var.tp_size <= 128 && floor(var.tp_size) == var.tp_size
    error_message = "The tp_size must be a whole number from 0 to 128."
  }
}

variable "max_model_len" {
  description = "vLLM --max-model-len on both engines."
  type        = number
  default     = 32768
}

variable "kvpush_repo_url" {
  description = "Git URL the nodes clone kvpush from (scripts/ and the package)."
  type        = string

  validation {
    condition     = can(regex("^(https://|git@)", var.kvpush_repo_url))
    error_message = "The kvpush_repo_url must be an https:// or git@ URL."
  }
}

variable "kvpush_ref" {
  description = "Release tag of kvpush that the nodes install (v0.2.0; CHANGELOG.md lists the releases). Never a branch or an arbitrary commit: a branch moves, and nodes started a day apart would run different code; the node set-up checks that the installed kvpush reports this version."
  type        = string

  validation {
    condition     = can(regex("^v[0-9]+\\.[0-9]+\\.[0-9]+(-rc[0-9]+)?$", var.kvpush_ref))
    error_message = "The kvpush_ref must be a release tag such as \"v0.2.0\", not a branch or a commit."
  }
}

variable "vllm_pip_spec" {
  description = "pip requirement for vLLM on NVIDIA nodes."
  type        = string
  default     = "vllm==0.33.0"
}

variable "vllm_neuron_pip_spec" {
  description = "pip requirement for vLLM on Trainium, used only when the Neuron DLAMI has no vLLM virtualenv of its own."
  type        = string
  default     = "vllm-neuron"
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

variable "efa_installer_version" {
  description = "EFA installer to run when the AMI's libfabric has no working EFA provider."
  type        = string
  default     = "1.50.0"

  validation {
    condition     = can(regex("^[0-9]+\\.[0-9]+\\.[0-9]+$", var.efa_installer_version))
    error_message = "The efa_installer_version must look like \"1.50.0\"."
  }
}

variable "efa_disable_huge_pages" {
  description = "Write FI_EFA_USE_HUGE_PAGE=0 into the node env file (needed when the engine forks worker processes after registering memory)."
  type        = bool
  default     = false
}

variable "results_bucket" {
  description = "Existing S3 bucket that the nodes may write results to (under kvpush/). Empty: no S3 access."
  type        = string
  default     = ""

  validation {
    condition     = var.results_bucket == "" || can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.results_bucket))
    error_message = "The results_bucket must be empty or a valid S3 bucket name."
  }
}

variable "tags" {
  description = "Tags added to every resource."
  type        = map(string)
  default     = {}
}
