//! Loading, attributes and identity of the plugin under test.

mod common;

use std::path::Path;
use std::sync::Arc;
use tpu_dynamo_runtime::*;

#[test]
fn attributes_and_identity() {
    let plugin = common::plugin();
    let (major, minor) = plugin.api_version();
    println!(
        "plugin {} PJRT API {major}.{minor}",
        plugin.path().display()
    );
    assert!((major, minor) >= (0, 54));
    let attributes = plugin.attributes().unwrap();
    println!("attributes: {attributes:?}");
    let xla = plugin.attribute_str("xla_version").expect("xla_version");
    let stablehlo = plugin
        .attribute_str("stablehlo_current_version")
        .expect("stablehlo version");
    assert!(
        !xla.is_empty() && stablehlo.split('.').count() == 3,
        "{stablehlo}"
    );
    let identity = plugin.identity();
    println!("identity: {identity}");
    assert!(identity.contains(&format!("pjrt_api={major}.{minor}")));
    assert!(
        identity.contains(&stablehlo) && identity.contains(&plugin.path().display().to_string())
    );
    assert_eq!(identity, plugin.identity());
}

#[test]
fn loads_once_per_path() {
    let plugin = common::plugin();
    let again = Plugin::load(plugin.path()).unwrap();
    assert!(Arc::ptr_eq(&plugin, &again));
    let client = Client::new(again, &ClientOptions::default()).unwrap();
    assert_eq!(client.platform_name().unwrap(), "cpu");
    assert!(!client.platform_version().unwrap().is_empty());
    let devices = client.devices();
    assert!(!devices.is_empty());
    assert_eq!(devices[0].id(), 0);
    println!(
        "devices: {devices:?} kind {:?} hw {}",
        devices[0].kind(),
        devices[0].local_hardware_id()
    );
}

#[test]
fn missing_plugin_path_is_an_error() {
    let missing = Path::new("/nonexistent/plugin.so");
    match Plugin::load(missing) {
        Err(Error::Load { path, .. }) => assert_eq!(path, missing),
        other => panic!("expected Load error, got {other:?}"),
    }
    let err = Plugin::discover(Some(missing)).unwrap_err();
    assert!(
        matches!(&err, Error::PluginNotFound { searched } if searched[0].contains("/nonexistent"))
    );
    let text = err.to_string();
    assert!(
        text.contains("pip install xla-cpu-pjrt") && text.contains("TPU_DYNAMO_PJRT_PLUGIN"),
        "{text}"
    );
    // A file that is not a PJRT plugin.
    let not_plugin = std::env::temp_dir().join(format!("not-a-plugin-{}.so", std::process::id()));
    std::fs::write(&not_plugin, b"nope").unwrap();
    assert!(matches!(Plugin::load(&not_plugin), Err(Error::Load { .. })));
    std::fs::remove_file(not_plugin).unwrap();
}

#[test]
fn libtpu_is_never_initialized_without_tpu_hardware() {
    let dir = std::env::temp_dir().join(format!("fake-libtpu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("libtpu.so");
    std::fs::write(&fake, b"not really libtpu").unwrap();
    let err = Plugin::load(&fake).unwrap_err();
    assert!(matches!(err, Error::Load { .. }), "{err}");
    if !tpu_dynamo_runtime::discover::tpu_hardware_present() {
        assert!(err.to_string().contains("no TPU hardware"), "{err}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
