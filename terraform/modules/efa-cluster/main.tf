locals {
  tags = merge(var.tags, {
    "kvpush:cluster" = var.name
  })

  tp_size = var.tp_size > 0 ? var.tp_size : local.profile.default_tp_size

  # The nodes, keyed "prefill-0", "decode-0", ...: the key is also the Name tag suffix.
  accelerated_nodes = merge(
    { for i in range(var.prefill_count) : "prefill-${i}" => { role = "prefill", index = i } },
    { for i in range(var.decode_count) : "decode-${i}" => { role = "decode", index = i } },
  )

  # Network interfaces of one accelerated node, derived from its network-card count.
  # efa-only (AWS's current guidance): card 0 / device 0 is the ENA primary that carries IP traffic,
  # card 0 / device 1 and device 0 of every other card are EFA-only, so every card carries one EFA
  # device and none of them burns an IP-traffic queue.
  # efa (the older layout): one EFA-with-ENA interface per card.
  efa_only_interfaces = concat(
    [{ network_card_index = 0, device_index = 0, interface_type = "interface", primary = true }],
    [for card in range(local.profile.network_cards) : {
      network_card_index = card
      device_index       = card == 0 ? 1 : 0
      interface_type     = "efa-only"
      primary            = false
    }],
  )
  efa_interfaces = [for card in range(local.profile.network_cards) : {
    network_card_index = card
    device_index       = card == 0 ? 0 : 1
    interface_type     = "efa"
    primary            = card == 0
  }]
  network_interfaces = var.efa_interface_mode == "efa-only" ? local.efa_only_interfaces : local.efa_interfaces

  # Values every node's set-up script gets; the role and the accelerator specifics are added per node.
  node_setup = {
    cluster               = var.name
    instance_type         = var.instance_type
    accelerator_count     = local.profile.accelerator_count
    efa_expected          = local.profile.network_cards
    efa_installer_version = var.efa_installer_version
    efa_installer_sha256  = var.efa_installer_sha256
    efa_disable_huge_page = var.efa_disable_huge_pages
    model                 = var.model
    tp_size               = local.tp_size
    max_model_len         = var.max_model_len
    kv_buffer_device      = local.profile.kv_buffer_device
    proxy_port            = var.ports.proxy
    prefill_port          = var.ports.prefill
    decode_port           = var.ports.decode
    side_channel_port     = var.ports.side_channel
    kvpush_repo_url       = var.kvpush_repo_url
    kvpush_ref            = var.kvpush_ref
    vllm_pip_spec         = var.vllm_pip_spec
    vllm_neuron_pip_spec  = var.vllm_neuron_pip_spec
    results_bucket        = var.results_bucket
    hmac_key_secret       = local.hmac_key_secret_name
    hmac_key_file         = local.hmac_key_file
    node_user             = var.node_user
  }
}

data "aws_partition" "current" {}

# AMIs are pinned (ami_id, proxy_ami_id, or a versioned SSM parameter); a floating "latest"/"current"
# parameter only with allow_latest_ami, so two nodes made a day apart do not boot different images.
locals {
  accelerated_ami_parameter = var.ami_ssm_parameter != "" ? var.ami_ssm_parameter : local.profile.ami_ssm_parameter
  proxy_ami_parameter       = var.proxy_ami_ssm_parameter != "" ? var.proxy_ami_ssm_parameter : local.proxy_ami_ssm_parameter
  floating_ami              = "/(latest|current)/"
}

data "aws_ssm_parameter" "accelerated_ami" {
  count = var.ami_id == "" ? 1 : 0

  name = local.accelerated_ami_parameter

  lifecycle {
    precondition {
      condition     = var.allow_latest_ami || length(regexall(local.floating_ami, local.accelerated_ami_parameter)) == 0
      error_message = "The accelerated nodes' AMI would float (${local.accelerated_ami_parameter}): set ami_id, or ami_ssm_parameter to a versioned parameter, or allow_latest_ami = true to accept it."
    }
  }
}

data "aws_ssm_parameter" "proxy_ami" {
  count = var.create_proxy_node && var.proxy_ami_id == "" ? 1 : 0

  name = local.proxy_ami_parameter

  lifecycle {
    precondition {
      condition     = var.allow_latest_ami || length(regexall(local.floating_ami, local.proxy_ami_parameter)) == 0
      error_message = "The proxy node's AMI would float (${local.proxy_ami_parameter}): set proxy_ami_id, or proxy_ami_ssm_parameter to a dated parameter, or allow_latest_ami = true to accept it."
    }
  }
}

locals {
  accelerated_ami_id = var.ami_id != "" ? var.ami_id : data.aws_ssm_parameter.accelerated_ami[0].insecure_value
  proxy_ami_id       = var.proxy_ami_id != "" ? var.proxy_ami_id : try(data.aws_ssm_parameter.proxy_ami[0].insecure_value, "")
}

# The set-up script of each role (the user data): one template whose sections are chosen by the
# accelerator ("none" on the proxy node).
locals {
  setup_scripts = {
    for role in ["prefill", "decode", "proxy"] : role => templatefile("${path.module}/templates/node-setup.sh.tftpl", merge(local.node_setup, {
      role        = role
      accelerator = role == "proxy" ? "none" : local.profile.accelerator
    }))
  }
}
