"""The one exception type for unreadable or invalid Caffe files."""


class ProtoError(ValueError):
    """A Caffe file (prototxt, caffemodel, binaryproto, solverstate) could not be read or upgraded.

    The message names the file and, for text files, the line, column and offending field.
    """
