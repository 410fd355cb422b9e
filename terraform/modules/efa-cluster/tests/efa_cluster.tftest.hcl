# Plan-level tests of the module with a mocked AWS provider: no credentials, no API calls.
# Needs Terraform >= 1.7 and the hashicorp/aws provider available locally (`terraform init`).

mock_provider "aws" {
  mock_data "aws_ssm_parameter" {
    defaults = {
      insecure_value = "ami-0123456789abcdef0"
    }
  }

  mock_data "aws_secretsmanager_random_password" {
    defaults = {
      random_password = "MockKeyMockKeyMockKeyMockKeyMockKeyMockKey12"
    }
  }

  # ARNs the provider validates when the mocked plan is applied (the key's runs below use apply)
  mock_resource "aws_iam_instance_profile" {
    defaults = {
      arn = "arn:aws:iam::111122223333:instance-profile/kvpush-test-node"
    }
  }

  mock_resource "aws_launch_template" {
    defaults = {
      id = "lt-0123456789abcdef0"
    }
  }

  mock_resource "aws_secretsmanager_secret" {
    defaults = {
      arn = "arn:aws:secretsmanager:us-east-2:111122223333:secret:kvpush-test/kvpush-hmac-key-AbCdEf"
    }
  }

  mock_data "aws_partition" {
    defaults = {
      partition = "aws"
    }
  }
}

variables {
  name            = "kvpush-test"
  instance_type   = "p5en.48xlarge"
  vpc_id          = "vpc-0123456789abcdef0"
  subnet_id       = "subnet-0123456789abcdef0"
  client_cidrs    = ["203.0.113.10/32"]
  kvpush_repo_url = "https://github.com/your-org/kvpush.git"
  kvpush_ref      = "v0.2.0"
  # the mocked SSM parameters stand for the floating ones; the runs below pin or refuse them
  allow_latest_ami = true
}

run "p5en_interfaces_follow_network_cards" {
  command = plan

  assert {
    condition     = length(aws_launch_template.accelerated["prefill"].network_interfaces) == 17
    error_message = "p5en.48xlarge: expected the ENA primary plus 16 EFA-only interfaces."
  }

  assert {
    condition     = length([for ni in aws_launch_template.accelerated["decode"].network_interfaces : ni if ni.interface_type == "efa-only"]) == 16
    error_message = "p5en.48xlarge: expected one EFA-only interface per network card."
  }

  assert {
    condition     = one([for ni in aws_launch_template.accelerated["prefill"].network_interfaces : ni.interface_type if ni.network_card_index == 0 && ni.device_index == 0]) == "interface"
    error_message = "The primary interface (card 0, device 0) must be ENA."
  }

  assert {
    condition     = length(distinct([for ni in aws_launch_template.accelerated["prefill"].network_interfaces : ni.subnet_id])) == 1
    error_message = "Every interface must be in the one cluster subnet."
  }

  assert {
    condition     = aws_launch_template.accelerated["prefill"].metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 must be required."
  }

  assert {
    condition     = aws_launch_template.accelerated["prefill"].block_device_mappings[0].ebs[0].encrypted == "true" && aws_launch_template.accelerated["prefill"].block_device_mappings[0].ebs[0].volume_type == "gp3"
    error_message = "The root volume must be encrypted gp3."
  }

  assert {
    condition     = aws_placement_group.cluster[0].strategy == "cluster"
    error_message = "The placement group must use the cluster strategy."
  }

  assert {
    condition     = aws_vpc_security_group_ingress_rule.cluster_self.ip_protocol == "-1" && aws_vpc_security_group_egress_rule.cluster_self.ip_protocol == "-1"
    error_message = "The cluster group must allow all protocols in and out with itself."
  }

  assert {
    condition     = length(aws_instance.accelerated) == 2 && length(aws_instance.proxy) == 1
    error_message = "Expected one prefill, one decode and one proxy node."
  }

  assert {
    condition     = strcontains(output.setup_scripts["prefill"], "KVPUSH_ROLE=$ROLE") && strcontains(output.setup_scripts["prefill"], "readonly ROLE=\"prefill\"")
    error_message = "The prefill set-up script must write its role into the env file."
  }
}

run "trn1_has_eight_cards" {
  command = plan

  variables {
    instance_type = "trn1.32xlarge"
  }

  assert {
    condition     = length([for ni in aws_launch_template.accelerated["prefill"].network_interfaces : ni if ni.interface_type == "efa-only"]) == 8
    error_message = "trn1.32xlarge: expected 8 EFA-only interfaces."
  }

  assert {
    condition     = strcontains(output.setup_scripts["decode"], "neuron-ls")
    error_message = "Trainium nodes must check their Neuron devices."
  }
}

run "legacy_efa_layout" {
  command = plan

  variables {
    instance_type      = "trn2.48xlarge"
    efa_interface_mode = "efa"
  }

  assert {
    condition     = length(aws_launch_template.accelerated["prefill"].network_interfaces) == 16 && alltrue([for ni in aws_launch_template.accelerated["prefill"].network_interfaces : ni.interface_type == "efa"])
    error_message = "efa mode: one EFA (with ENA) interface per card."
  }
}

run "capacity_block" {
  command = plan

  variables {
    capacity = {
      type           = "capacity-block"
      reservation_id = "cr-0123456789abcdef0"
    }
  }

  assert {
    condition     = aws_launch_template.accelerated["prefill"].instance_market_options[0].market_type == "capacity-block"
    error_message = "A Capacity Block needs market_type capacity-block."
  }

  assert {
    condition     = aws_launch_template.accelerated["prefill"].capacity_reservation_specification[0].capacity_reservation_target[0].capacity_reservation_id == "cr-0123456789abcdef0"
    error_message = "A Capacity Block needs its reservation as the target."
  }

  assert {
    condition     = length(aws_placement_group.cluster) == 0 && length(aws_launch_template.accelerated["prefill"].placement) == 0
    error_message = "Capacity Blocks are launched without a placement group."
  }
}

run "rejects_open_client_cidr" {
  command = plan

  variables {
    client_cidrs = ["0.0.0.0/0"]
  }

  expect_failures = [var.client_cidrs]
}

run "rejects_unknown_instance_type" {
  command = plan

  variables {
    instance_type = "p4d.24xlarge"
  }

  expect_failures = [var.instance_type]
}

run "rejects_reservation_without_id" {
  command = plan

  variables {
    capacity = {
      type = "odcr"
    }
  }

  expect_failures = [var.capacity]
}

run "nodes_are_private_by_default" {
  command = plan

  assert {
    condition     = length(aws_eip.accelerated) == 0
    error_message = "No Elastic IP on the nodes unless assign_public_ips is set."
  }

  assert {
    condition     = alltrue([for ni in aws_launch_template.proxy[0].network_interfaces : ni.associate_public_ip_address == "false"])
    error_message = "The proxy node gets no public address unless assign_public_ips is set."
  }
}

run "public_ips_only_when_asked" {
  command = plan

  variables {
    assign_public_ips = true
  }

  assert {
    condition     = length(aws_eip.accelerated) == 2
    error_message = "assign_public_ips = true gives each accelerated node an Elastic IP."
  }
}

run "a_branch_is_refused_as_kvpush_ref" {
  command = plan

  variables {
    kvpush_ref = "main"
  }

  expect_failures = [var.kvpush_ref]
}

run "a_malformed_efa_installer_checksum_is_refused" {
  command = plan

  variables {
    efa_installer_sha256 = "not-a-checksum"
  }

  expect_failures = [var.efa_installer_sha256]
}

run "the_hmac_key_is_a_secret_only_the_node_role_reads" {
  command = apply

  assert {
    condition     = aws_secretsmanager_secret_version.hmac_key.secret_id == aws_secretsmanager_secret.hmac_key.id && aws_secretsmanager_secret_version.hmac_key.secret_string == "MockKeyMockKeyMockKeyMockKeyMockKeyMockKey12"
    error_message = "The generated key must be the secret's value."
  }

  assert {
    condition     = aws_secretsmanager_secret.hmac_key.name == "kvpush-test/kvpush-hmac-key" && aws_secretsmanager_secret.hmac_key.kms_key_id == null
    error_message = "The secret is named after the cluster and encrypted with the account's Secrets Manager key by default."
  }

  assert {
    condition     = aws_iam_role_policy.hmac_key.role == aws_iam_role.node.id && jsondecode(aws_iam_role_policy.hmac_key.policy).Statement == [{ Sid = "ReadTheClusterKey", Effect = "Allow", Action = ["secretsmanager:GetSecretValue"], Resource = aws_secretsmanager_secret.hmac_key.arn }]
    error_message = "The node role, and only this grant, may read exactly this secret."
  }

  assert {
    condition     = alltrue([for role, script in output.setup_scripts : strcontains(script, "cluster key --region \"$REGION\" --secret-id \"kvpush-test/kvpush-hmac-key\"") && strcontains(script, "HMAC_KEY_FILE=\"/etc/kvpush/hmac.key\"") && !strcontains(script, "MockKeyMockKey")])
    error_message = "Every node copies the key from the secret into /etc/kvpush/hmac.key, and no script holds the key."
  }

  assert {
    condition     = !strcontains(jsonencode([output.cluster_env, output.nodes, output.hmac_key_secret_arn, output.instance_profile]), "MockKeyMockKey")
    error_message = "No output may show the key."
  }
}

run "a_customer_kms_key_encrypts_the_secret_and_the_node_role_may_decrypt_through_secrets_manager" {
  command = apply

  variables {
    secrets_kms_key_id = "arn:aws:kms:us-east-2:111122223333:key/0123abcd-0123-0123-0123-0123456789ab"
  }

  assert {
    condition     = aws_secretsmanager_secret.hmac_key.kms_key_id == var.secrets_kms_key_id
    error_message = "secrets_kms_key_id must encrypt the secret."
  }

  assert {
    condition     = jsondecode(aws_iam_role_policy.hmac_key.policy).Statement[1] == { Sid = "DecryptTheClusterKey", Effect = "Allow", Action = ["kms:Decrypt"], Resource = var.secrets_kms_key_id, Condition = { StringLike = { "kms:ViaService" = "secretsmanager.*.amazonaws.com" } } }
    error_message = "The node role may use that key only through Secrets Manager."
  }
}

run "rejects_a_kms_key_that_is_not_an_arn" {
  command = plan

  variables {
    secrets_kms_key_id = "alias/my-key"
  }

  expect_failures = [var.secrets_kms_key_id]
}

run "a_floating_ami_is_refused_unless_asked_for" {
  command = plan

  variables {
    allow_latest_ami = false
  }

  expect_failures = [data.aws_ssm_parameter.accelerated_ami, data.aws_ssm_parameter.proxy_ami]
}

run "pinned_amis_need_no_ssm_parameter" {
  command = plan

  variables {
    allow_latest_ami = false
    ami_id           = "ami-0aaaaaaaaaaaaaaaa"
    proxy_ami_id     = "ami-0bbbbbbbbbbbbbbbb"
  }

  assert {
    condition     = aws_launch_template.accelerated["prefill"].image_id == "ami-0aaaaaaaaaaaaaaaa" && aws_launch_template.proxy[0].image_id == "ami-0bbbbbbbbbbbbbbbb"
    error_message = "The pinned AMIs must be the ones the launch templates use."
  }
}

run "a_cidr_wider_than_a_site_is_refused" {
  command = plan

  variables {
    client_cidrs = ["0.0.0.0/1"]
  }

  expect_failures = [var.client_cidrs]
}

run "a_commit_is_refused_as_kvpush_ref" {
  command = plan

  variables {
    kvpush_ref = "0123456789abcdef0123456789abcdef01234567"
  }

  expect_failures = [var.kvpush_ref]
}
