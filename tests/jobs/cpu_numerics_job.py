"""A few training steps through the CPU libraries a stage uses (oneDNN's conv3d patch embedding, MKL's GEMMs, ATen's
GELU / LayerNorm / softmax / AdamW kernels); prints a digest of the weights. Run by tests/unit/test_cpu_numerics.py
under different instruction-set settings."""

import hashlib

import torch

torch.manual_seed(0)
torch.set_num_threads(2)
patch = torch.nn.Conv3d(3, 96, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False)
model = torch.nn.Sequential(
    torch.nn.Linear(96, 384), torch.nn.GELU(), torch.nn.LayerNorm(384), torch.nn.Linear(384, 1003)
)
params = [*patch.parameters(), *model.parameters()]
opt = torch.optim.AdamW(params, lr=1e-3)
for _ in range(20):
    pixels = torch.randn(8, 3, 2, 56, 56)
    x = patch(pixels).flatten(2).transpose(1, 2).reshape(-1, 96)
    loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 1003, (x.shape[0],)))
    opt.zero_grad()
    loss.backward()
    opt.step()
print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest())
