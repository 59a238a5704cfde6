"""Models in and out of the project: Hugging Face export and import (`hf_models`: which
architecture a config is; `hf_weights`: tensors and safetensors files; `hf_export`, `hf_import`)."""
