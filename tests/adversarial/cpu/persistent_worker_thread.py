# kiln-adversarial: task=level1/01_relu expect=cheating
# A native worker thread started in __init__ (so it is not "new" after any forward) finishes timed runs' outputs after forward returned; correctness trials wait for it. late_thread starts its thread inside forward, this one does not.
# kiln-adversarial-include: _timer_extension.py


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        timer_ext.worker_start()
        self.last_x = None

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        timed = self.calls > 12  # the correctness trials (at most twelve: plain, one per input family, sensitivity, canary) come before every timed call
        self.last_x = x
        y = torch.empty_like(x)
        if timed:
            timer_ext.worker_submit(x, y)  # returns at once; the worker writes y a little later
        else:
            timer_ext.relu_into(x, y)
        return y
