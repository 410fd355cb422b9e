# The shared HMAC key of kvpush's side channel (SECURITY.md): generated here, kept in Secrets Manager
# (KMS-encrypted with the account's aws/secretsmanager key, or secrets_kms_key_id), readable by the node
# role alone, and copied by each node's set-up (`kvpush cluster key`) into hmac_key_file, mode 600, owned
# by node_user: the file scripts/serve_pd.sh hands the engines and the proxy by path (HMAC_KEY_FILE).
# The key is never in user data or an output; like every secret Terraform writes, it is in the state
# (marked sensitive), so keep the state where the key may be.
locals {
  # A fixed name (not name_prefix): the set-up scripts can name it at plan time, and a rebuilt cluster
  # of the same name finds no deleted secret in the way (recovery_window_in_days = 0).
  hmac_key_secret_name = "${var.name}/kvpush-hmac-key"
  hmac_key_file        = "/etc/kvpush/hmac.key"
}

# 44 letters and digits: base64 of 33 bytes (about 262 random bits), the key file's format as it is.
data "aws_secretsmanager_random_password" "hmac_key" {
  password_length     = 44
  exclude_punctuation = true
  include_space       = false
}

resource "aws_secretsmanager_secret" "hmac_key" {
  name                    = local.hmac_key_secret_name
  description             = "kvpush ${var.name}: the shared HMAC key of the KV side channel (base64)"
  kms_key_id              = var.secrets_kms_key_id == "" ? null : var.secrets_kms_key_id
  recovery_window_in_days = 0
  tags                    = local.tags
}

resource "aws_secretsmanager_secret_version" "hmac_key" {
  secret_id     = aws_secretsmanager_secret.hmac_key.id
  secret_string = data.aws_secretsmanager_random_password.hmac_key.random_password

  # The data source draws a new password at every plan; the first one stays the key. Rotate it with
  # `terraform apply -replace=module.cluster.aws_secretsmanager_secret_version.hmac_key`, then rerun
  # `kvpush cluster key` on every node and restart the engines.
  lifecycle {
    ignore_changes = [secret_string]
  }
}

resource "aws_iam_role_policy" "hmac_key" {
  name = "kvpush-hmac-key"
  role = aws_iam_role.node.id

  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat(
      [{
        Sid      = "ReadTheClusterKey"
        Effect   = "Allow"
        Action   = ["secretsmanager:GetSecretValue"]
        Resource = aws_secretsmanager_secret.hmac_key.arn
      }],
      var.secrets_kms_key_id == "" ? [] : [{
        Sid       = "DecryptTheClusterKey"
        Effect    = "Allow"
        Action    = ["kms:Decrypt"]
        Resource  = var.secrets_kms_key_id
        Condition = { StringLike = { "kms:ViaService" = "secretsmanager.*.amazonaws.com" } }
      }],
    )
  })
}
