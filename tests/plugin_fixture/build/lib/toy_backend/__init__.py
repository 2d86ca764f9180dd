"""A third-party backend package: one ACCEL device that claims nothing but ADD."""

from llamapy.backend.cpu import CPU_BUFT, CPUBackend
from llamapy.backend.interface import Device, DeviceProps, Registry
from llamapy.types import DeviceType


class ToyDevice(Device):
    name = "TOY0"
    type = DeviceType.ACCEL

    def props(self):
        return DeviceProps(self.name, "toy accelerator", self.type)

    def buffer_type(self):
        return CPU_BUFT

    def supports_buft(self, buft):
        return buft.is_host

    def supports_op(self, node):
        return node.op.name == "ADD"

    def init_backend(self):
        return CPUBackend(self)


class ToyRegistry(Registry):
    name = "TOY"

    def devices(self):
        return [ToyDevice()]


def registry():
    return ToyRegistry()


def broken_registry():
    raise ImportError("libtoy.so: cannot open shared object file")
