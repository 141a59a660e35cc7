# kiln-adversarial: task=level1/01_relu expect=runtime
# Looks for other candidates' builds and for the host: the directory its extension was loaded from and the one above it, its working directory, the host's name; raises with what it saw.
# kiln-adversarial-include: _relu_extension.py


load = getattr(__builtins__, "__imp" + "ort__") if not isinstance(__builtins__, dict) else __builtins__["__imp" + "ort__"]
os = load("o" + "s")


def look() -> str:
    own = os.path.dirname(os.path.realpath(adv.__file__))
    above = os.path.dirname(own)
    others = [name for name in os.listdir(above) if name != os.path.basename(own)]
    return f"builds at {above}: others={len(others)} {sorted(others)[:3]}; cwd={os.getcwd()}; host={os.uname().nodename}"


class ModelNew(nn.Module):
    def forward(self, x):
        raise ValueError(look())
