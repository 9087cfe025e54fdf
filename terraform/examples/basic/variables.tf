variable "image" {
  description = "caravan container image, pushed to a registry every Nomad client can pull from."
  type        = string
  default     = "caravan:0.1.0"
}

variable "datacenters" {
  description = "Nomad datacenters caravan's own jobs may run in."
  type        = list(string)
  default     = ["*"]
}
