# kiln-adversarial: task=level1/01_relu expect=pass
# A correct kernel whose Python uses what reads its own frames: namedtuple, typing.NamedTuple and enum at import, logging and traceback inside forward.
# kiln-adversarial-include: _relu_extension.py
import collections
import enum
import logging
import traceback
import typing

Shape = collections.namedtuple("Shape", "rows cols")


class Mode(enum.Enum):
    FAST = 1


class Plan(typing.NamedTuple):
    mode: Mode
    shape: Shape


log = logging.getLogger("candidate")


class ModelNew(nn.Module):
    def forward(self, x):
        plan = Plan(Mode.FAST, Shape(*x.shape))
        try:
            raise ValueError(plan)
        except ValueError:
            log.debug(traceback.format_exc())
        traceback.extract_stack(limit=8)
        return adv.relu_out(x)
