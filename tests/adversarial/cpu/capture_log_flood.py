# kiln-adversarial: task=level1/01_relu expect=runtime
# At module level, writes a gigabyte to its standard error and then aborts, so that the verifier reads the log for its tail.
import torch
import torch.nn as nn

load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
os = load("o" + "s")

chunk = b"kiln log flood " * (1 << 16)
for _ in range(1024):
    try:
        os.write(2, chunk)
    except OSError:
        break
getattr(os, "ab" + "ort")()


class ModelNew(nn.Module):
    def forward(self, x):
        return x
