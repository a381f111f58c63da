"""torchtitan_ext: context parallelism for torchtitan's multimodal muse_glimmer."""
