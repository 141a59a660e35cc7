# kiln-adversarial: task=level1/01_relu expect=runtime
# A wrong answer (zeros) that fills the GPU's memory in forward and keeps it, so that the verifier's next draw runs out of device memory (infra, score 0, before the rule: now its sandbox's driver figure decides).
# kiln-adversarial-include: _relu_extension.py

HOARD = []


def fill(device) -> None:
    for chunk in (1 << 30, 64 << 20):
        while True:
            try:
                HOARD.append(torch.empty((chunk,), dtype=torch.uint8, device=device))
            except torch.OutOfMemoryError:
                break


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.zeros_like(x)
        if not HOARD:
            fill(x.device)
        return y
