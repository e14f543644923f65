package io.cmroot.spark;

import io.cmroot.core.AppConf;
import org.apache.spark.SparkEnv;

/** The Spark application's static conf (the SparkConf every SparkEnv shares) for the core. */
public final class SparkAppConf implements AppConf {
  static {
    AppConf.Registry.register(new SparkAppConf());
  }

  private SparkAppConf() {}

  @Override
  public boolean running() {
    return SparkEnv.get() != null;
  }

  @Override
  public String get(String key) {
    SparkEnv env = SparkEnv.get();
    return env == null ? null : env.conf().get(key, null);
  }
}
