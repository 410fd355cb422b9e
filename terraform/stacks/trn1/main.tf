# kvpush test cluster on trn1.32xlarge or trn1n.32xlarge (16x Trainium, 8 or 16 x 100 Gb/s EFA):
# one prefill node, one decode node, one proxy/bench node, in one subnet of one AZ.
#
# What vLLM Neuron supports here: nothing for disaggregated serving. vLLM Neuron (Neuron SDK >= 2.31,
# the plugin the Neuron DLAMIs ship) runs disaggregated inference on Trn2 and Trn3 only; NxDI, the older
# engine, dropped Trn1 in SDK 2.29. So this stack is for kvpush's own demo and benchmark between the two
# nodes (Trainium HBM over NIXL's LIBFABRIC plugin and EFA: trn1.32xlarge has two Trainium devices per
# EFA), not for vLLM push-vs-pull runs; use the trn2 stack for those. The node set-up writes
# KVPUSH_VLLM_NEURON=unsupported into /etc/kvpush/node.env. None of this has run on a trn1 instance.

provider "aws" {
  region = var.region

  default_tags {
    tags = {
      "kvpush:stack" = "trn1"
      "managed-by"   = "terraform"
    }
  }
}

module "network" {
  source = "../../modules/network"

  name               = var.name
  region             = var.region
  availability_zone  = var.availability_zone
  create_vpc         = var.existing_subnet_id == ""
  existing_vpc_id    = var.existing_vpc_id
  existing_subnet_id = var.existing_subnet_id
  nat_gateway        = !var.public_ips
  tags               = var.tags
}

module "cluster" {
  source = "../../modules/efa-cluster"

  name          = var.name
  instance_type = var.instance_type
  vpc_id        = module.network.vpc_id
  subnet_id     = module.network.subnet_id

  prefill_count     = var.prefill_count
  decode_count      = var.decode_count
  client_cidrs      = var.client_cidrs
  ssh_key_name      = var.ssh_key_name
  assign_public_ips = var.public_ips && module.network.has_internet_gateway
  capacity          = var.capacity

  existing_placement_group = var.existing_placement_group

  model                   = var.model
  tp_size                 = var.tp_size
  kvpush_repo_url         = var.kvpush_repo_url
  kvpush_ref              = var.kvpush_ref
  ami_id                  = var.ami_id
  proxy_ami_id            = var.proxy_ami_id
  ami_ssm_parameter       = var.ami_ssm_parameter
  proxy_ami_ssm_parameter = var.proxy_ami_ssm_parameter
  allow_latest_ami        = var.allow_latest_ami

  efa_installer_sha256 = var.efa_installer_sha256
  results_bucket       = var.results_bucket
  tags                 = var.tags
}
