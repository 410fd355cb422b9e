# Two groups. "cluster" is on every interface of every node: all protocols in and out with itself, which
# EFA requires (its SRD traffic is not TCP/UDP) and which also covers the vLLM ports and the NIXL side
# channel between nodes. "client" is on the primary interfaces only: SSH and the proxy port from
# client_cidrs.

resource "aws_security_group" "cluster" {
  name_prefix = "${var.name}-cluster-"
  description = "kvpush ${var.name}: EFA and node-to-node traffic (self only)"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-cluster" })

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "cluster_self" {
  security_group_id            = aws_security_group.cluster.id
  referenced_security_group_id = aws_security_group.cluster.id
  ip_protocol                  = "-1"
  description                  = "All traffic from cluster members (EFA, vLLM, NIXL side channel)"
  tags                         = local.tags
}

resource "aws_vpc_security_group_egress_rule" "cluster_self" {
  security_group_id            = aws_security_group.cluster.id
  referenced_security_group_id = aws_security_group.cluster.id
  ip_protocol                  = "-1"
  description                  = "All traffic to cluster members (EFA requires the self egress rule)"
  tags                         = local.tags
}

resource "aws_vpc_security_group_egress_rule" "internet" {
  count = var.allow_internet_egress ? 1 : 0

  security_group_id = aws_security_group.cluster.id
  cidr_ipv4         = "0.0.0.0/0"
  ip_protocol       = "-1"
  description       = "Package and model downloads during set-up"
  tags              = local.tags
}

resource "aws_security_group" "client" {
  name_prefix = "${var.name}-client-"
  description = "kvpush ${var.name}: SSH and the proxy port from client_cidrs"
  vpc_id      = var.vpc_id
  tags        = merge(local.tags, { Name = "${var.name}-client" })

  lifecycle {
    create_before_destroy = true
  }
}

locals {
  client_ports = {
    ssh   = 22
    proxy = var.ports.proxy
  }
  client_rules = {
    for pair in setproduct(keys(local.client_ports), var.client_cidrs) :
    "${pair[0]}-${pair[1]}" => { port = local.client_ports[pair[0]], cidr = pair[1], what = pair[0] }
  }
}

resource "aws_vpc_security_group_ingress_rule" "client" {
  for_each = local.client_rules

  security_group_id = aws_security_group.client.id
  cidr_ipv4         = each.value.cidr
  ip_protocol       = "tcp"
  from_port         = each.value.port
  to_port           = each.value.port
  description       = "${each.value.what} from a client network"
  tags              = local.tags
}
