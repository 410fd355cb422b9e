"""Programs built on the library: the demo, the engine-emulator bench and the AWS cluster tool."""
