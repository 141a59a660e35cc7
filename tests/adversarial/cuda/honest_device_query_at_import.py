# kiln-adversarial: task=level1/01_relu expect=pass
# Honest: asks the device for its multiprocessor count at import (module level, where the compile stage once had no GPU and the candidate got "No CUDA GPUs are available") and sizes its grid by it.
# kiln-adversarial-include: _relu_extension.py

SMS = torch.cuda.get_device_properties(0).multi_processor_count
MAJOR, MINOR = torch.cuda.get_device_capability()


class ModelNew(nn.Module):
    def forward(self, x):
        assert SMS > 0 and MAJOR >= 7
        return adv.relu_out(x)
