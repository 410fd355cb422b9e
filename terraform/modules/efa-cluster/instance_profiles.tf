# What the module needs to know about each supported accelerated instance type. network_cards and
# max_efa_interfaces are DescribeInstanceTypes facts (tests/infra compares them with moto's snapshot of
# that API, and `kvpush cluster check` with the live one). One EFA device goes on every network card.
# accelerator picks the section of templates/node-setup.sh.tftpl that prepares the node.

locals {
  instance_profiles = {
    "p5en.48xlarge" = {
      accelerator        = "nvidia"
      accelerator_name   = "H200"
      accelerator_count  = 8
      network_cards      = 16
      max_efa_interfaces = 16
      card_gbps          = 200
      default_tp_size    = 8
      kv_buffer_device   = "cuda"
      ami_ssm_parameter  = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"
    }
    "trn1.32xlarge" = {
      accelerator        = "neuron"
      accelerator_name   = "Trainium"
      accelerator_count  = 16
      network_cards      = 8
      max_efa_interfaces = 8
      card_gbps          = 100
      default_tp_size    = 32
      kv_buffer_device   = "cuda" # vllm-neuron: "cuda" = device HBM as VRAM; "neuron" fails vLLM's check
      ami_ssm_parameter  = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"
    }
    "trn1n.32xlarge" = {
      accelerator        = "neuron"
      accelerator_name   = "Trainium"
      accelerator_count  = 16
      network_cards      = 16
      max_efa_interfaces = 16
      card_gbps          = 100
      default_tp_size    = 32
      kv_buffer_device   = "cuda" # vllm-neuron: "cuda" = device HBM as VRAM; "neuron" fails vLLM's check
      ami_ssm_parameter  = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"
    }
    "trn2.48xlarge" = {
      accelerator        = "neuron"
      accelerator_name   = "Trainium2"
      accelerator_count  = 16
      network_cards      = 16
      max_efa_interfaces = 16
      card_gbps          = 200
      default_tp_size    = 64
      kv_buffer_device   = "cuda" # vllm-neuron: "cuda" = device HBM as VRAM; "neuron" fails vLLM's check
      ami_ssm_parameter  = "/aws/service/neuron/dlami/multi-framework/ubuntu-24.04/latest/image_id"
    }
  }

  # The small node that runs the proxy and the load generator: plain Ubuntu, one ENA interface.
  proxy_ami_ssm_parameter = "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id"

  profile = local.instance_profiles[var.instance_type]
}
