"""Memory of a training step (a package): the closed-form terms, one walk of the step, and its hooks.

- ``memplan.memory.terms``: one small pure function per tensor, the bytes it takes;
- ``memplan.memory.walk``: one walk of a training step (``_StepWalk``), op by op, that finds the peak;
- ``memplan.memory.sharding``: the sharding hooks: DDP's buckets and FSDP2's shards, all-gathers and
  reduce-scatters;
- ``memplan.memory.peak``: ``peak_memory`` / ``peak_memory_of_rank`` and the ``MemoryBreakdown`` they report.

The stacks' hooks (transformers, litgpt, torchtune) are ``memplan.memory.stacks.Stack``. Torch-free. Every name
callers use is re-exported here.
"""

from __future__ import annotations

from memplan.memory.terms import (INDEX_BYTES, MASK_BYTES, ADAMW_STATES_PER_PARAM, SGD_STATES_PER_PARAM,
                                  ADAM_STEP_BYTES, BNB_BLOCK, LOWP_WEIGHT_BYTES, NORM_BACKWARD_FP32_BUFFERS,
                                  NORM_FORWARD_FP32_BUFFERS, act_bytes, residual_bytes_per_element, tokens,
                                  lora_matrix_params, lora_params, lora_tensors, trainable_params, lora_saved_bytes,
                                  weight_bytes, rope_buffer_bytes, rope_cast_bytes, lowp_weight_copy_bytes,
                                  gradient_bytes, layer_gradient_bytes, decay_params, optimizer_state_bytes,
                                  optimizer_temporary_bytes, input_bytes, residual_stream_bytes, norm_stat_bytes,
                                  norm_output_bytes, qkv_output_bytes, rotated_q_bytes, rotated_k_bytes,
                                  sdpa_output_bytes, sdpa_logsumexp_bytes, attention_scores_bytes, causal_mask_bytes,
                                  eager_q_bytes, eager_kv_bytes, sdpa_repeated_kv_bytes, attention_output_copy_bytes,
                                  mlp_up_bytes, mlp_inner_bytes, layer_lowp_weight_bytes, layer_activation_terms,
                                  block_input_bytes, selective_kept_bytes, saved_per_layer_bytes,
                                  first_block_unsaved_bytes, first_block_frozen_mlp_bytes,
                                  first_block_frozen_weight_copy_bytes, lora_unsaved_bytes, logits_bytes,
                                  fp32_logits_bytes, head_weight_grad_bytes, stack_adapter_state_bytes,
                                  activation_terms, GLIBC_MMAP_THRESHOLD_MAX, largest_transient_bytes,
                                  glibc_heap_retention_bytes, mapped_logits_high_water_bytes, runtime_bytes,
                                  TRANSFORMERS_CODE_BYTES, PEFT_CODE_BYTES, model_code_resident_bytes,
                                  DATASETS_CODE_BYTES, trainer_datasets_resident_bytes,
                                  LIBRARY_CODE_BYTES, library_code_resident_bytes, COMPILE_IMPORT_BYTES,
                                  COMPILE_GRAPH_BYTES, COMPILE_LAYER_BYTES, compiled_code_resident_bytes,
                                  sdpa_gqa_repeats, _matrix_shapes)
from memplan.memory.sharding import (COLLECTIVES, COLLECTIVES_OF_FAMILY, ddp_bucket_bytes, ddp_separate_bucket_bytes,
                                     gradients_persist, param_shapes, shard_rows, padded_shard_numel,
                                     local_shard_numel, fsdp_gather_bytes, fsdp_reduce_bytes, fsdp_group_numel,
                                     fsdp_sharded_weight_bytes, fsdp_unsharded_bytes, fsdp_copy_in_bytes,
                                     fsdp_reduce_scatter_input_bytes, fsdp_sharded_grad_bytes,
                                     fsdp_all_sharded_grad_bytes, fsdp_local_params, fsdp_optimizer_state_bytes,
                                     fsdp_optimizer_temporary_bytes, gloo_reduce_scatter_copy_bytes,
                                     fsdp_compute_setup)
from memplan.memory.walk import (CATEGORIES, Moment, _walk_step, walk_step)
from memplan.memory.peak import (MemoryBreakdown, peak_memory, peak_memory_of_rank)

__all__ = ['INDEX_BYTES', 'MASK_BYTES', 'ADAMW_STATES_PER_PARAM', 'SGD_STATES_PER_PARAM', 'ADAM_STEP_BYTES',
           'BNB_BLOCK', 'LOWP_WEIGHT_BYTES', 'NORM_BACKWARD_FP32_BUFFERS', 'NORM_FORWARD_FP32_BUFFERS', 'act_bytes',
           'residual_bytes_per_element', 'tokens', 'lora_matrix_params', 'lora_params', 'lora_tensors',
           'trainable_params', 'lora_saved_bytes', 'weight_bytes', 'rope_buffer_bytes', 'rope_cast_bytes',
           'lowp_weight_copy_bytes', 'gradient_bytes', 'layer_gradient_bytes', 'decay_params',
           'optimizer_state_bytes', 'optimizer_temporary_bytes', 'input_bytes', 'residual_stream_bytes',
           'norm_stat_bytes', 'norm_output_bytes', 'qkv_output_bytes', 'rotated_q_bytes', 'rotated_k_bytes',
           'sdpa_output_bytes', 'sdpa_logsumexp_bytes', 'attention_scores_bytes', 'causal_mask_bytes',
           'eager_q_bytes', 'eager_kv_bytes', 'sdpa_repeated_kv_bytes', 'attention_output_copy_bytes', 'mlp_up_bytes',
           'mlp_inner_bytes', 'layer_lowp_weight_bytes', 'layer_activation_terms', 'block_input_bytes',
           'selective_kept_bytes', 'saved_per_layer_bytes', 'first_block_unsaved_bytes',
           'first_block_frozen_mlp_bytes', 'first_block_frozen_weight_copy_bytes', 'lora_unsaved_bytes',
           'logits_bytes', 'fp32_logits_bytes', 'head_weight_grad_bytes', 'stack_adapter_state_bytes',
           'activation_terms', 'GLIBC_MMAP_THRESHOLD_MAX', 'largest_transient_bytes', 'glibc_heap_retention_bytes',
           'mapped_logits_high_water_bytes', 'runtime_bytes', 'TRANSFORMERS_CODE_BYTES', 'PEFT_CODE_BYTES',
           'model_code_resident_bytes', 'DATASETS_CODE_BYTES', 'trainer_datasets_resident_bytes', 'LIBRARY_CODE_BYTES', 'library_code_resident_bytes',
           'COMPILE_IMPORT_BYTES', 'COMPILE_GRAPH_BYTES', 'COMPILE_LAYER_BYTES', 'compiled_code_resident_bytes', 'sdpa_gqa_repeats', '_matrix_shapes', 'COLLECTIVES', 'COLLECTIVES_OF_FAMILY',
           'ddp_bucket_bytes', 'ddp_separate_bucket_bytes', 'gradients_persist', 'param_shapes', 'shard_rows',
           'padded_shard_numel', 'local_shard_numel', 'fsdp_gather_bytes', 'fsdp_reduce_bytes', 'fsdp_group_numel',
           'fsdp_sharded_weight_bytes', 'fsdp_unsharded_bytes', 'fsdp_copy_in_bytes',
           'fsdp_reduce_scatter_input_bytes', 'fsdp_sharded_grad_bytes', 'fsdp_all_sharded_grad_bytes',
           'fsdp_local_params', 'fsdp_optimizer_state_bytes', 'fsdp_optimizer_temporary_bytes',
           'gloo_reduce_scatter_copy_bytes', 'fsdp_compute_setup', 'CATEGORIES', 'Moment', '_walk_step', 'walk_step',
           'MemoryBreakdown', 'peak_memory', 'peak_memory_of_rank']
