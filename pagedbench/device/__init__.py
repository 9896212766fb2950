"""Device basics every room uses: device and dtype names, host<->device copies, device timing."""
