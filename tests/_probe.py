import os, torch, torch.distributed as dist
def ok(x):
    t = torch.tensor([dist.get_rank() * x]); dist.all_reduce(t); return {"r": dist.get_rank(), "t": t}
def fail():
    if dist.get_rank() == 1: raise ValueError("boom")
    dist.barrier()
def hang():
    if dist.get_rank() == 0: dist.barrier()
    import time; time.sleep(1000)
def die():
    if dist.get_rank() == 1: os._exit(3)
    dist.barrier()
def tt():
    import torchtitan.trainer
    return dist.get_rank()
