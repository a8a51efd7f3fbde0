"""HAL types: memory vocabulary, records, allocators, buffers, devices and tensors."""
