# One role for every node: find the cluster's nodes (`kvpush cluster` on the proxy node), optionally
# write results to S3, optionally be reachable through SSM Session Manager.

resource "aws_iam_role" "node" {
  name_prefix = "${var.name}-node-"
  description = "kvpush test cluster ${var.name}: node role"

  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Principal = { Service = "ec2.amazonaws.com" }
      Action    = "sts:AssumeRole"
    }]
  })

  tags = local.tags
}

resource "aws_iam_role_policy" "discover" {
  name = "kvpush-discover"
  role = aws_iam_role.node.id

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat(
      [{
        Sid      = "DescribeClusterNodes"
        Effect   = "Allow"
        Action   = ["ec2:DescribeInstances", "ec2:DescribeInstanceTypes", "ec2:DescribeNetworkInterfaces"]
        Resource = "*"
      }],
      var.results_bucket == "" ? [] : [{
        Sid      = "WriteResults"
        Effect   = "Allow"
        Action   = ["s3:PutObject", "s3:GetObject"]
        Resource = "arn:${data.aws_partition.current.partition}:s3:::${var.results_bucket}/kvpush/*"
      }],
    )
  })
}

resource "aws_iam_role_policy_attachment" "ssm" {
  count = var.enable_ssm ? 1 : 0

  role       = aws_iam_role.node.name
  policy_arn = "arn:${data.aws_partition.current.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "node" {
  name_prefix = "${var.name}-node-"
  role        = aws_iam_role.node.name
  tags        = local.tags
}
