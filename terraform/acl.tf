# Least-privilege ACL policies for caravan's processes (docs/security.md).
# Created only when manage_acl_policies is true; tokens are not created here,
# because a token made by Terraform lands in its state: create them with
# `consul acl token create -policy-name ...` / `nomad acl token create -policy ...`
# and store them in the jobs' Nomad Variables (jobspecs/README.md).

locals {
  acl_policy_vars = {
    kv_prefix = var.kv_prefix
    # Earlier versions of each profile live beside the prefix (caravan-history/
    # for caravan/), out of the scheduler's watch of the prefix.
    kv_history_prefix = "${trimsuffix(var.kv_prefix, "/")}-history/"
    namespace         = var.namespace
  }
  consul_policies = var.manage_acl_policies ? toset(["scheduler", "router", "operator"]) : toset([])
  nomad_policies  = var.manage_acl_policies ? toset(["scheduler", "router", "operator"]) : toset([])
}

resource "consul_acl_policy" "caravan" {
  for_each = local.consul_policies

  name        = "caravan-${each.key}"
  description = "caravan ${each.key} (least privilege, see docs/security.md)"
  rules       = templatefile("${path.module}/policies/caravan-${each.key}.consul.hcl.tftpl", local.acl_policy_vars)
}

resource "nomad_acl_policy" "caravan" {
  for_each = local.nomad_policies

  name        = "caravan-${each.key}"
  description = "caravan ${each.key} (least privilege, see docs/security.md)"
  rules_hcl   = templatefile("${path.module}/policies/caravan-${each.key}.nomad.hcl.tftpl", local.acl_policy_vars)
}
