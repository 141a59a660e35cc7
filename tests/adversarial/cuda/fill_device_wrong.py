# kiln-adversarial: task=level1/01_relu expect=runtime|correctness
# A wrong answer (zeros) that fills the GPU's memory in forward and keeps it, so that the verifier's next draw runs out of device memory (infra, score 0, before the rule). Now its sandbox's driver figure decides an OOM (runtime); where no draw runs out first, its zeros are caught (correctness): the race decides which -1, never infra.
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
