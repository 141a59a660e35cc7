# kiln-adversarial: task=level1/01_relu expect=compile
# At module level, writes one "unsupported call" message of 7 MB straight onto the compile stage's socket, for the verdict and both caches to store whole.
import torch
import torch.nn as nn

load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
os = load("o" + "s")
stat = load("st" + "at")


def frame(text: bytes) -> bytes:
    body = b"\x82\xa5event\xabunsupported\xa7message\xdb" + len(text).to_bytes(4, "big") + text
    return len(body).to_bytes(4, "little") + body


for fd in range(3, 64):
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            os.write(fd, frame(b"kiln giant text: " + b"x" * (7 << 20)))
    except OSError:
        continue


class ModelNew(nn.Module):
    def forward(self, x):
        return x
