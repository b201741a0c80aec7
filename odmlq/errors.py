"""Errors raised by odmlq.

Every error derives from `OdmlqError` and from the builtin it resembles, so a
caller may catch either. Messages name the culprit (rule index and field,
module path, op, file, batch index), the value, the valid choices, and the fix.
"""


class OdmlqError(Exception):
    """Base class of every error odmlq raises on purpose."""


class RuleError(OdmlqError, ValueError):
    """A quantization rule, or a rules file, is invalid."""


class QTypeError(OdmlqError, ValueError):
    """An unknown quantized type, or one used where it cannot be."""


class GranularityError(OdmlqError, ValueError):
    """A granularity that does not fit the tensor it is applied to."""


class CalibrationError(OdmlqError, ValueError):
    """Calibration statistics are missing, invalid or inconsistent."""


class TraceError(OdmlqError, RuntimeError):
    """The model could not be traced into a graph."""


class PlanError(OdmlqError, ValueError):
    """A plan is inconsistent, or a serialized plan cannot be read.

    Attributes:
      ops: the op ids whose decisions conflict, where the check knows them
        (an op and the producer of an edge it reads in another qtype), so a
        caller choosing precisions per op can resolve the conflict.
    """

    def __init__(self, message: str = "", *, ops: tuple[str, ...] = ()):
        super().__init__(message)
        self.ops = tuple(ops)
