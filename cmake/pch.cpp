// Anchors the shared precompiled header of LibTorch (see DtcTorch.cmake).
