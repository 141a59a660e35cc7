# kiln-adversarial: task=level1/01_relu expect=cheating
# The persistent worker of persistent_worker_thread, slowed: it finishes each timed output about 0.3 ms after forward returned, when the sandbox has made the next calls. Outputs the sandbox freed by then would take the late write into a heap block in use (a crash, or another call's output changed); the sandbox keeps each output until the next trip's same call, so the write lands in it and the snapshot at return shows it unfinished.
# kiln-adversarial-include: _timer_extension.py


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        timer_ext.worker_start()

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        y = torch.empty_like(x)
        if self.calls > 12:  # the correctness trials (at most twelve: plain, one per input family, sensitivity, canary) come before every timed call
            timer_ext.worker_submit_after(x, y, 300)
        else:
            timer_ext.relu_into(x, y)
        return y
