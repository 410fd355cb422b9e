# A cluster placement group keeps prefill and decode on nearby hosts. Capacity Blocks are already
# placed together (and are launched without a group); an On-Demand Capacity Reservation should be
# created inside a cluster placement group, which is then passed as existing_placement_group.
locals {
  launch_in_placement_group = var.use_placement_group && var.capacity.type != "capacity-block"
  create_placement_group    = local.launch_in_placement_group && var.existing_placement_group == ""
  placement_group_name = (
    !local.launch_in_placement_group ? null :
    local.create_placement_group ? aws_placement_group.cluster[0].name : var.existing_placement_group
  )
}

resource "aws_placement_group" "cluster" {
  count = local.create_placement_group ? 1 : 0

  name     = "${var.name}-cluster"
  strategy = "cluster"
  tags     = local.tags
}

# One launch template per accelerated role: the same hardware layout, a set-up script that knows its role.
resource "aws_launch_template" "accelerated" {
  for_each = toset(["prefill", "decode"])

  name_prefix   = "${var.name}-${each.key}-"
  description   = "kvpush ${var.name}: ${each.key} node (${var.instance_type})"
  image_id      = local.accelerated_ami_id
  instance_type = var.instance_type
  key_name      = var.ssh_key_name == "" ? null : var.ssh_key_name
  ebs_optimized = true

  user_data = base64encode(local.setup_scripts[each.key])

  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  block_device_mappings {
    device_name = "/dev/sda1"

    ebs {
      volume_type           = "gp3"
      volume_size           = var.root_volume_size_gb
      iops                  = 16000
      throughput            = 1000
      encrypted             = true
      kms_key_id            = var.kms_key_id == "" ? null : var.kms_key_id
      delete_on_termination = true
    }
  }

  dynamic "placement" {
    for_each = local.launch_in_placement_group ? ["cluster"] : []

    content {
      group_name = local.placement_group_name
    }
  }

  dynamic "network_interfaces" {
    for_each = local.network_interfaces

    content {
      network_card_index    = network_interfaces.value.network_card_index
      device_index          = network_interfaces.value.device_index
      interface_type        = network_interfaces.value.interface_type
      subnet_id             = var.subnet_id
      security_groups       = network_interfaces.value.primary ? [aws_security_group.cluster.id, aws_security_group.client.id] : [aws_security_group.cluster.id]
      delete_on_termination = true
      description           = "${var.name} ${each.key} card ${network_interfaces.value.network_card_index} device ${network_interfaces.value.device_index}"
    }
  }

  dynamic "instance_market_options" {
    for_each = var.capacity.type == "capacity-block" ? ["capacity-block"] : []

    content {
      market_type = instance_market_options.value
    }
  }

  dynamic "capacity_reservation_specification" {
    for_each = var.capacity.type == "on-demand" ? [] : [var.capacity.reservation_id]

    content {
      capacity_reservation_target {
        capacity_reservation_id = capacity_reservation_specification.value
      }
    }
  }

  # One dynamic block rather than two static ones: tfparse (tests/infra) drops the last network
  # interface when static repeated blocks follow the dynamic network_interfaces block.
  dynamic "tag_specifications" {
    for_each = ["volume", "network-interface"]

    content {
      resource_type = tag_specifications.value
      tags          = merge(local.tags, { "kvpush:role" = each.key })
    }
  }

  tags = local.tags
}

resource "aws_instance" "accelerated" {
  for_each = local.accelerated_nodes

  launch_template {
    id      = aws_launch_template.accelerated[each.value.role].id
    version = aws_launch_template.accelerated[each.value.role].latest_version
  }

  tags = merge(local.tags, {
    Name           = "${var.name}-${each.key}"
    "kvpush:role"  = each.value.role
    "kvpush:index" = tostring(each.value.index)
  })

  lifecycle {
    precondition {
      condition     = local.profile.network_cards <= local.profile.max_efa_interfaces
      error_message = "The instance profile of ${var.instance_type} asks for more EFA interfaces than the type supports."
    }
  }
}

# Instances with several network interfaces get no automatic public address; an Elastic IP on the
# primary (ENA) interface gives SSH access and internet egress through the internet gateway.
resource "aws_eip" "accelerated" {
  for_each = var.assign_public_ips ? local.accelerated_nodes : {}

  domain            = "vpc"
  network_interface = aws_instance.accelerated[each.key].primary_network_interface_id
  tags              = merge(local.tags, { Name = "${var.name}-${each.key}" })
}

resource "aws_launch_template" "proxy" {
  count = var.create_proxy_node ? 1 : 0

  name_prefix   = "${var.name}-proxy-"
  description   = "kvpush ${var.name}: proxy and load-generator node"
  image_id      = local.proxy_ami_id
  instance_type = var.proxy_instance_type
  key_name      = var.ssh_key_name == "" ? null : var.ssh_key_name

  user_data = base64encode(local.setup_scripts["proxy"])

  iam_instance_profile {
    arn = aws_iam_instance_profile.node.arn
  }

  metadata_options {
    http_endpoint               = "enabled"
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    instance_metadata_tags      = "disabled"
  }

  block_device_mappings {
    device_name = "/dev/sda1"

    ebs {
      volume_type           = "gp3"
      volume_size           = 200
      encrypted             = true
      kms_key_id            = var.kms_key_id == "" ? null : var.kms_key_id
      delete_on_termination = true
    }
  }

  network_interfaces {
    device_index                = 0
    interface_type              = "interface"
    subnet_id                   = var.subnet_id
    security_groups             = [aws_security_group.cluster.id, aws_security_group.client.id]
    associate_public_ip_address = var.assign_public_ips
    delete_on_termination       = true
  }

  tag_specifications {
    resource_type = "volume"
    tags          = merge(local.tags, { "kvpush:role" = "proxy" })
  }

  tags = local.tags
}

resource "aws_instance" "proxy" {
  count = var.create_proxy_node ? 1 : 0

  launch_template {
    id      = aws_launch_template.proxy[0].id
    version = aws_launch_template.proxy[0].latest_version
  }

  tags = merge(local.tags, {
    Name           = "${var.name}-proxy-0"
    "kvpush:role"  = "proxy"
    "kvpush:index" = "0"
  })
}
