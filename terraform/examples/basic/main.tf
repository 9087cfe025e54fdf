# A root module that deploys caravan with the example profiles of this
# repository. Both providers take their address and token from the
# environment: NOMAD_ADDR and NOMAD_TOKEN, CONSUL_HTTP_ADDR and
# CONSUL_HTTP_TOKEN.

terraform {
  required_version = ">= 1.3.0"

  required_providers {
    nomad = {
      source  = "hashicorp/nomad"
      version = ">= 2.0.0"
    }
    consul = {
      source  = "hashicorp/consul"
      version = ">= 2.20.0"
    }
  }
}

provider "nomad" {}

provider "consul" {}

module "caravan" {
  source = "../.."

  image       = var.image
  datacenters = var.datacenters
  # caravan's own namespace, created first (docs/deploy.md section 2:
  # `nomad namespace apply caravan`); the replica jobs go there too.
  namespace      = "caravan"
  cluster_config = file("${path.module}/cluster.yaml")

  profile_files = [
    "${path.module}/../../../examples/profiles/qwen-vllm-h100.yaml",
    "${path.module}/../../../examples/profiles/tiny-llamacpp-cpu.yaml",
    "${path.module}/../../../examples/profiles/llama-llamacpp-l4.yaml",
  ]
}
