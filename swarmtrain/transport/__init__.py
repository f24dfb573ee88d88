from swarmtrain.transport.streams import TensorTransport, TransportConfig, handler_name

__all__ = ["TensorTransport", "TransportConfig", "handler_name"]
