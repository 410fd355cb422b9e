# One VPC, one cluster subnet in one AZ. The nodes get no automatic public address (instances with
# several network interfaces cannot). By default (nat_gateway = true) the cluster subnet is private: its
# default route goes to a NAT gateway in a small public subnet, so the nodes can install packages and
# reach SSM without any public address of their own. With nat_gateway = false the cluster subnet routes
# straight to the internet gateway, for nodes the cluster module gives Elastic IPs.

locals {
  existing_ids_given = var.existing_vpc_id != "" && var.existing_subnet_id != ""
  az_in_region       = can(regex("^${var.region}[a-z]$", var.availability_zone))
}

resource "aws_vpc" "this" {
  count = var.create_vpc ? 1 : 0

  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = merge(var.tags, { Name = "${var.name}-vpc" })

  lifecycle {
    precondition {
      condition     = local.az_in_region
      error_message = "The availability_zone ${var.availability_zone} is not a zone of the region ${var.region}."
    }
  }
}

resource "aws_internet_gateway" "this" {
  count = var.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(var.tags, { Name = "${var.name}-igw" })
}

resource "aws_subnet" "cluster" {
  count = var.create_vpc ? 1 : 0

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = var.subnet_cidr
  availability_zone       = var.availability_zone
  map_public_ip_on_launch = false

  tags = merge(var.tags, { Name = "${var.name}-cluster" })

  lifecycle {
    precondition {
      condition = (
        tonumber(split("/", var.subnet_cidr)[1]) >= tonumber(split("/", var.vpc_cidr)[1]) &&
        cidrsubnet("${split("/", var.subnet_cidr)[0]}/${split("/", var.vpc_cidr)[1]}", 0, 0) == cidrsubnet(var.vpc_cidr, 0, 0)
      )
      error_message = "The subnet_cidr must lie inside vpc_cidr."
    }
  }
}

resource "aws_route_table" "cluster" {
  count = var.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(var.tags, { Name = "${var.name}-cluster" })
}

resource "aws_route" "internet" {
  count = var.create_vpc ? 1 : 0

  route_table_id         = aws_route_table.cluster[0].id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = var.nat_gateway ? null : aws_internet_gateway.this[0].id
  nat_gateway_id         = var.nat_gateway ? aws_nat_gateway.this[0].id : null
}

# The NAT gateway's own subnet: only the NAT gateway lives here.
resource "aws_subnet" "nat" {
  count = var.create_vpc && var.nat_gateway ? 1 : 0

  vpc_id                  = aws_vpc.this[0].id
  cidr_block              = var.nat_subnet_cidr
  availability_zone       = var.availability_zone
  map_public_ip_on_launch = false

  tags = merge(var.tags, { Name = "${var.name}-nat" })
}

resource "aws_route_table" "nat" {
  count = var.create_vpc && var.nat_gateway ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(var.tags, { Name = "${var.name}-nat" })
}

resource "aws_route" "nat_internet" {
  count = var.create_vpc && var.nat_gateway ? 1 : 0

  route_table_id         = aws_route_table.nat[0].id
  destination_cidr_block = "0.0.0.0/0"
  gateway_id             = aws_internet_gateway.this[0].id
}

resource "aws_route_table_association" "nat" {
  count = var.create_vpc && var.nat_gateway ? 1 : 0

  subnet_id      = aws_subnet.nat[0].id
  route_table_id = aws_route_table.nat[0].id
}

resource "aws_eip" "nat" {
  count = var.create_vpc && var.nat_gateway ? 1 : 0

  domain = "vpc"
  tags   = merge(var.tags, { Name = "${var.name}-nat" })
}

resource "aws_nat_gateway" "this" {
  count = var.create_vpc && var.nat_gateway ? 1 : 0

  allocation_id = aws_eip.nat[0].id
  subnet_id     = aws_subnet.nat[0].id
  tags          = merge(var.tags, { Name = "${var.name}-nat" })

  depends_on = [aws_internet_gateway.this]
}

resource "aws_route_table_association" "cluster" {
  count = var.create_vpc ? 1 : 0

  subnet_id      = aws_subnet.cluster[0].id
  route_table_id = aws_route_table.cluster[0].id
}

data "aws_subnet" "existing" {
  count = var.create_vpc ? 0 : 1

  id = var.existing_subnet_id

  lifecycle {
    precondition {
      condition     = local.existing_ids_given
      error_message = "With create_vpc = false, set both existing_vpc_id and existing_subnet_id."
    }

    postcondition {
      condition     = self.vpc_id == var.existing_vpc_id && self.availability_zone == var.availability_zone
      error_message = "The existing subnet must belong to existing_vpc_id and lie in availability_zone."
    }
  }
}

# Take over the new VPC's default security group and leave it without rules, so that nothing launched
# into the VPC without an explicit group gets any access.
resource "aws_default_security_group" "this" {
  count = var.create_vpc ? 1 : 0

  vpc_id = aws_vpc.this[0].id
  tags   = merge(var.tags, { Name = "${var.name}-default-unused" })
}
